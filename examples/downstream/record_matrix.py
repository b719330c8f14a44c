"""The JAX loop's run in one `fpemu matrix` environment: the trace goes to $FPEMU_TRACE_DIR."""

import os
import pathlib

from fpemu.traces import write_trace
from loops import jax_loop

write_trace(jax_loop.train(), pathlib.Path(os.environ["FPEMU_TRACE_DIR"]) / "jax_loop.json")
