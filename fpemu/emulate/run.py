"""``fpemu emulate``: a user's model file, N steps under a policy and a scaler profile, as a trace and a report."""

from __future__ import annotations

import pathlib

from fpemu.host import installed_versions
from fpemu.emulate.trace import emulation_trace
from fpemu.errors import FpemuInputError, raised
from fpemu.fileio import atomic_write
from fpemu.traces import Trace, trace_filename, write_trace

JAX_IMPLEMENTATION = "emulate_jax@cpu"


def emulate_file(path, *, policy=None, steps: int, profile=None, params=None, seed: int = 0, overrides=None,
                 semantics=None, on_step=None) -> Trace:
    """Run the model file at ``path`` (see ``fpemu.emulate._model_file``) under ``policy``.

    Args:
      path: the model file; its ``FRAMEWORK`` (torch, jax) chooses the emulator.
      policy: a :class:`fpemu.emulate.Policy` or a policy name (None: the framework's default,
        ``cuda_autocast_fp16`` for torch, ``program`` for JAX).
      steps: training steps to run (fewer if the scaler stops training).
      profile, params: the scaler profile (None: ``torch`` for torch, ``flax`` for JAX) and its parameters.
      seed: passed to the file's ``build``.
      overrides: Policy fields to replace; the policy is then named after them (``pure_fp16-fp8_e4m3fn-up``).
      semantics: JAX only: the interpreter's :data:`fpemu.steps.SEMANTICS` preset (default ``jax_cpu_strict``).
      on_step: called with ``"build"`` once the file is imported, then with each step's index before it
        runs (fpemu.emulate.isolated times each phase by it).

    Returns:
      The run's trace (v1): scale trajectory, skips, shares, per-module underflow, the op table.

    Raises:
      FpemuInputError: a file that breaks the contract, an op the policy cannot place, a step that raised.
    """
    from fpemu.emulate._model_file import framework_of, load_model_file
    from fpemu.emulate.policy import get_policy
    path = pathlib.Path(path)
    module, text = load_model_file(path)
    if on_step is not None:
        on_step("build")
    framework = framework_of(module, path)
    default_policy, default_profile, run = FRAMEWORKS[framework]
    if semantics is not None and framework != "jax":
        raise FpemuInputError(f"{path}: --semantics is the JAX interpreter's; this is a {framework} model file")
    policy = get_policy(policy or default_policy)
    if overrides:
        name = "-".join([policy.name, *("noSubnormals" if v is False else str(v) for v in overrides.values())])
        policy = get_policy(policy, **overrides, name=name)
    return run(module, text, path, policy=policy, steps=steps, profile=profile or default_profile,
               params=params or {}, seed=seed, semantics=semantics, on_step=on_step)


def _torch_file(module, text, path, *, policy, steps, profile, params, seed, semantics, on_step) -> Trace:
    import torch

    from fpemu.emulate._model_file import build_model
    from fpemu.emulate._torch_loop import run_steps
    from fpemu.emulate._torch_mode import op_table
    model, optimizer = build_model(module, path, seed)
    records, telemetry = run_steps(module.step, model, optimizer, steps=steps, policy=policy, profile=profile,
                                   params=params, where=str(path), on_step=on_step)
    packages = {**installed_versions(["numpy", "ml_dtypes"]), "torch": torch.__version__}
    return emulation_trace(records, profile=profile, params=params, model_name=path.stem, model_text=text,
                           policy=policy.describe(), op_table=op_table(policy), packages=packages,
                           run_telemetry=telemetry)


def _jax_file(module, text, path, *, policy, steps, profile, params, seed, semantics, on_step) -> Trace:
    from fpemu.emulate._jax_interpreter import primitive_table
    from fpemu.emulate._jax_loop import run_jax_steps
    from fpemu.steps.semantics import DEFAULT_SEMANTICS
    semantics = semantics or DEFAULT_SEMANTICS
    try:
        state = module.build(seed)
    except Exception as error:
        raise FpemuInputError(f"{path}: build({seed}) raised {raised(error)}") from error
    records, telemetry, _ = run_jax_steps(module.grads, module.update, state, steps=steps, policy=policy,
                                          semantics=semantics, profile=profile, params=params, where=str(path),
                                          on_step=on_step)
    packages = installed_versions(["numpy", "ml_dtypes", "jax", "jaxlib", "flax"])
    return emulation_trace(records, profile=profile, params=params, model_name=path.stem, model_text=text,
                           policy=policy.describe(), op_table=primitive_table(semantics), packages=packages,
                           run_telemetry=telemetry, implementation=JAX_IMPLEMENTATION)


# framework -> (its default policy, its default scaler profile, the function running its model file)
FRAMEWORKS = {"torch": ("cuda_autocast_fp16", "torch", _torch_file), "jax": ("program", "flax", _jax_file)}


def write_outputs(trace: Trace, out, plot: bool = True) -> list:
    """The trace, the report page and (with matplotlib) its heat map and trajectory, into ``out``."""
    from fpemu.emulate.report import report_markdown, write_plots
    out = pathlib.Path(out)
    stem = f"{trace.spec_name}.{trace.metadata['policy']['name']}"
    written = [write_trace(trace, out / trace_filename(stem, trace.metadata["implementation"]))]
    images = write_plots(trace, out, stem) if plot else []
    written.append(atomic_write(out / f"{stem}.md", report_markdown(trace, [p.name for p in images])))
    return written + images
