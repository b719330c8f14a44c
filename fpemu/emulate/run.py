"""``fpemu emulate``: a user's model file, N steps under a policy and a scaler profile, as a trace and a report."""

from __future__ import annotations

import pathlib

from fpemu.emulate.trace import IMPLEMENTATION, emulation_trace
from fpemu.fileio import atomic_write
from fpemu.traces import Trace, trace_filename, write_trace


def emulate_file(path, *, policy, steps: int, profile: str = "torch", params=None, seed: int = 0) -> Trace:
    """Run the model file at ``path`` (see ``fpemu.emulate._model_file``) under ``policy``.

    Args:
      path: the model file.
      policy: a :class:`fpemu.emulate.Policy` or a policy name.
      steps: training steps to run (fewer if the scaler stops training).
      profile, params: the scaler profile and its parameters.
      seed: passed to the file's ``build``.

    Returns:
      The run's trace (v1): scale trajectory, skips, shares, per-module underflow, the op table.

    Raises:
      FpemuInputError: a file that breaks the contract, an op the policy cannot place, a step that raised.
    """
    import torch

    from fpemu.emulate._model_file import build_model, load_model_file
    from fpemu.emulate._torch_loop import run_steps
    from fpemu.emulate._torch_mode import op_table
    from fpemu.emulate.policy import get_policy
    from fpemu.harness.run import package_versions
    policy = get_policy(policy)
    path = pathlib.Path(path)
    module, text = load_model_file(path)
    model, optimizer = build_model(module, path, seed)
    records, telemetry = run_steps(module.step, model, optimizer, steps=steps, policy=policy, profile=profile,
                                   params=params or {}, where=str(path))
    packages = {**package_versions(["numpy", "ml_dtypes"]), "torch": torch.__version__}
    return emulation_trace(records, profile=profile, params=params or {}, model_name=path.stem, model_text=text,
                           policy=policy.describe(), op_table=op_table(policy), packages=packages,
                           run_telemetry=telemetry)


def write_outputs(trace: Trace, out, plot: bool = True) -> list:
    """The trace, the report page and (with matplotlib) its heat map and trajectory, into ``out``."""
    from fpemu.emulate.report import report_markdown, write_plots
    out = pathlib.Path(out)
    stem = f"{trace.spec_name}.{trace.metadata['policy']['name']}"
    written = [write_trace(trace, out / trace_filename(stem, IMPLEMENTATION))]
    images = write_plots(trace, out, stem) if plot else []
    written.append(atomic_write(out / f"{stem}.md", report_markdown(trace, [p.name for p in images])))
    return written + images
