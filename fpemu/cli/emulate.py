"""The emulate command: a model file's training steps with every op rounded per a precision policy."""

from __future__ import annotations

import pathlib

from fpemu.cli import output
from fpemu.cli.questions import parse_params
from fpemu.emulate.isolated import DEFAULT_STEP_TIMEOUT
from fpemu.errors import FpemuInputError


def _threads(args):
    """The child's torch threads: --threads, else the parent's where it set them (a test's one thread)."""
    import sys
    if args.threads is not None:
        if args.threads < 1:
            raise FpemuInputError(f"--threads {args.threads}: expected at least 1")
        return args.threads
    return sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None


def _cmd_emulate(args) -> int:
    from fpemu.emulate.isolated import emulate_isolated
    from fpemu.emulate.policy import scaler_rules
    from fpemu.emulate.run import write_outputs
    from fpemu.kinds.bounds import MAX_SEED, bound_for
    overrides = {key: value for key, value in (("compute", args.format), ("rounding", args.rounding),
                                               ("accumulation", args.accumulation)) if value is not None}
    if args.flush_subnormals:
        overrides["subnormals"] = False
    most = bound_for("steps").limit("model")  # a model's steps, as a model-driven spec's are bounded
    if not 1 <= args.steps <= most:
        raise FpemuInputError(f"--steps {args.steps}: expected 1..{most:,} steps (a model spec's steps bound: each "
                              "step is run and stored)")
    if not 0 <= args.seed <= MAX_SEED:  # the file's build(seed) seeds torch, numpy or JAX: 32-bit seeds
        raise FpemuInputError(f"--seed {args.seed}: expected 0..{MAX_SEED:,} (a 32-bit seed)")
    params = parse_params(args.param)  # (checked before the child starts)
    if args.scaler is not None:  # a named scaler and its parameters too; the default is the file's framework's
        scaler_rules(args.scaler, params)
    # the trace and page are named after what ran (pure_fp16-fp8_e4m3fn-up); the file's FRAMEWORK picks the
    # emulator; the file runs in a child process, so a hang or an exit in it is a named error
    trace = emulate_isolated(args.model, step_timeout=args.step_timeout, timeout=args.timeout, threads=_threads(args),
                             progress=output.progress(args),
                             policy=args.policy, overrides=overrides, steps=args.steps, profile=args.scaler,
                             params=params, seed=args.seed, semantics=args.semantics)
    written = write_outputs(trace, args.out, plot=not args.no_plot)
    summary = trace.summary
    first = trace.metadata["telemetry"]["first_nonfinite"]
    ran = f"{trace.metadata['policy']['name']} / {trace.metadata['profile']}"
    lines = [f"{trace.spec_name} under {ran}: {summary['attempts']} steps, "
             f"{summary['skipped_updates']} skipped, final scale {summary['final_scale']:g}"]
    lines += [f"first inf/NaN ({d}): {e['op']} in {e['module']} at step {e['step']}" for d, e in sorted(first.items())]
    output.emit(args, {"summary": summary, "first_nonfinite": first, "written": [str(p) for p in written]},
          lines + output.written_lines(written))
    return 0


def _policy_help() -> str:
    """Every named policy, by the framework that emulates its placement (the first is the default)."""
    from fpemu.emulate.policy import PLACEMENT_FRAMEWORKS, POLICIES
    parts = []
    for framework in ("torch", "jax"):
        default, *others = [name for name, fields in POLICIES.items()
                            if framework in PLACEMENT_FRAMEWORKS[fields["placement"]]]
        parts.append(f"{framework}: " + ", ".join([f"{default} (default)", *others]))
    return "; ".join(parts)


def add_commands(registry) -> None:
    """emulate."""
    command = registry.command
    emulate = command("emulate", "run a model file's training steps with every op rounded per a precision policy "
                      "(torch: fpemu.emulate_torch; JAX: fpemu.emulate_jax) under a loss-scaler profile: writes the "
                      "trace and a report page (per-module underflow heat map, scale trajectory). A torch file defines "
                      "build(seed) -> (model, optimizer) and step(model, optimizer, scaler, index) -> loss, the step "
                      "using the torch.amp.GradScaler interface and no autocast of its own; a JAX file declares "
                      "FRAMEWORK = 'jax' and defines build(seed) -> state, grads(state, scale, index) -> (loss, "
                      "grads) and update(state, grads, index) -> state", _cmd_emulate)
    emulate.add_argument("model", type=pathlib.Path, help="the model file (.py)")
    emulate.add_argument("--policy", help=_policy_help())
    emulate.add_argument("--semantics", help="JAX: the interpreter's float32 arithmetic, a fpemu.steps.SEMANTICS "
                         "preset (default jax_cpu_strict: XLA:CPU's; jax_cpu: with XLA's default bf16 excess "
                         "precision; seed: IEEE, sequential sums)")
    emulate.add_argument("--steps", type=int, default=20, help="training steps (default 20; at most a model "
                         "spec's steps bound, docs/bounds.md)")
    emulate.add_argument("--scaler", help="the loss-scaler profile (default torch for torch files, flax for JAX "
                         "files; `fpemu simulate` takes the same names)")
    emulate.add_argument("--param", action="append", metavar="NAME=VALUE", help="a parameter of the scaler profile "
                         "(init_scale=2**16, growth_interval=100); repeat for several")
    emulate.add_argument("--format", help="the policy's compute format: a format name (fp8_e5m2, tf32, fp6_e3m2fn, "
                         "...; autocast policies take fp16 or bf16; custom formats: Policy(compute=make_format(...)))")
    emulate.add_argument("--rounding", help="rounding mode (nearest_even, toward_zero, stochastic, ...)")
    emulate.add_argument("--accumulation", choices=("fp32", "low"),
                         help="matmul, sum and conv accumulation (default fp32; low refuses other ops that may accumulate)")
    emulate.add_argument("--flush-subnormals", action="store_true", help="flush subnormal results to zero")
    emulate.add_argument("--seed", type=int, default=0, help="passed to the file's build(seed)")
    emulate.add_argument("--no-plot", action="store_true", help="write no PNG (the page still has the tables)")
    emulate.add_argument("--threads", type=int, help="torch intra-op threads (default torch's; 1 is often fastest "
                         "on a shared machine)")
    emulate.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT, metavar="SECONDS",
                         help=f"seconds the file's import, build() and each step may take (default "
                              f"{DEFAULT_STEP_TIMEOUT:g}); the file runs in a child process, killed past it")
    emulate.add_argument("--timeout", type=float, metavar="SECONDS", help="seconds the whole run may take "
                         "(default: no limit beyond --step-timeout)")
    emulate.add_argument("--out", type=pathlib.Path, default=output.DEFAULT_REPORTS / "emulate",
                         help="output folder (default reports/emulate)")
