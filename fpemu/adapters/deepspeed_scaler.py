"""DeepSpeed's loss scaling, driven for real: DynamicLossScaler, FP16_Optimizer and the engine.

One process can import only one DeepSpeed, so every DeepSpeed run happens in a worker
subprocess: one for the installed DeepSpeed and one for the 0.17.0 tree (the last
release before PR #6976 moved growth one good step later), put first on the worker's
``sys.path``.  Install that tree with::

    DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation \\
        --target ~/.cache/fpemu/deepspeed-0.17.0 deepspeed==0.17.0

(or point ``FPEMU_DEEPSPEED_0_17`` at another one).  A worker lives as long as the
process that started it; each call is one JSON line each way.

Which profile a DeepSpeed's DynamicLossScaler follows (``deepspeed`` or ``deepspeed_0_17``)
is asked of the class each worker loads (``_growth_rule``), not read from the version:
version.txt said 0.17.1 before PR #6976 changed the rule, so a source build from between
0.17.0 and the PR says 0.17.1 and grows as 0.17.0 does.

In each worker DeepSpeed's communication runs over a gloo world of one (a file://
rendezvous, as the torch adapters use); ``deepspeed_shm_comm`` is marked incompatible
first, as DeepSpeed itself does off Linux, because its TorchBackend otherwise
JIT-builds that op (measured here: 125 s the first time, then cached under
TORCH_EXTENSIONS_DIR) for all-reduces that a world of one never needs.

What each trace holds that DeepSpeed does not keep itself: DynamicLossScaler has no
growth counter, so ``growth_counter`` is worked out from its ``cur_iter`` and
``last_overflow_iter`` with the expression its own ``update_scale`` tests; and the
scaler does not decide about the step: ZeRO's ``step`` skips exactly the overflowing
steps (deepspeed/runtime/zero/stage_1_and_2.py), so ``applied`` is ``not overflow``
(FP16_Optimizer's ``applied`` is observed: whether the wrapped optimizer stepped).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import select
import math
import os
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

import numpy as np

from fpemu.adapters.observed import observed_trace
from fpemu.scalers.profiles import get_profile

TREE_0_17_ENV = "FPEMU_DEEPSPEED_0_17"
DEFAULT_TREE_0_17 = os.path.join("~", ".cache", "fpemu", "deepspeed-0.17.0")


# --- which DeepSpeed ------------------------------------------------------------

def tree_0_17() -> str:
    """Where the DeepSpeed 0.17.0 tree is expected."""
    return os.path.expanduser(os.environ.get(TREE_0_17_ENV, DEFAULT_TREE_0_17))


def tree_0_17_unavailable() -> Optional[str]:
    """None if the 0.17.0 tree is there and what it requires is installed here, else why not."""
    if _tree_missing(tree_0_17()):
        return (f"no DeepSpeed tree at {tree_0_17()} (set {TREE_0_17_ENV}, or DS_BUILD_OPS=0 pip install --no-deps "
                f"--no-build-isolation --target {tree_0_17()} deepspeed==0.17.0)")
    missing = _tree_requirements_missing(tree_0_17())
    if missing:  # the tree was installed --no-deps: its worker would die importing one of them
        return (f"the DeepSpeed tree at {tree_0_17()} needs {', '.join(missing)}, not installed here "
                f"(pip install {' '.join(missing)}, or the deepspeed extra: pip install 'fpemu[deepspeed]')")
    return None


def _tree_requirements_missing(tree: str) -> list:
    """The distributions the tree's DeepSpeed requires (its extras aside) that this environment lacks."""
    import importlib.metadata
    import re
    wanted = [requirement for dist in importlib.metadata.distributions(path=[tree])
              if dist.metadata["Name"] == "deepspeed" for requirement in dist.requires or ()
              if "extra ==" not in requirement]
    names = [re.match(r"[A-Za-z0-9_.-]+", requirement).group(0) for requirement in wanted]
    missing = []
    for name in dict.fromkeys(names):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _tree_missing(tree: str) -> bool:
    return not os.path.isfile(os.path.join(tree, "deepspeed", "__init__.py"))


def tree_0_17_versions() -> dict:
    """The DeepSpeed version of the 0.17.0 tree, read from its dist-info (no worker started)."""
    import importlib.metadata
    found = [d.version for d in importlib.metadata.distributions(path=[tree_0_17()])
             if d.metadata["Name"] == "deepspeed"]
    return {"deepspeed": found[0] if found else "not installed"}


def scaler_profile(tree: Optional[str] = None) -> str:
    """The profile that DynamicLossScaler (engine config) follows in the installed DeepSpeed (tree None)
    or the tree at ``tree``: ``deepspeed`` or ``deepspeed_0_17``, asked of the class itself (see
    ``_growth_rule``), not read from the version, which a source build between 0.17.0 and PR #6976
    already gives as 0.17.1."""
    return _worker(tree).profile


# --- the worker's side ----------------------------------------------------------

def _deepspeed_comm():
    """DeepSpeed's communication over a gloo world of one, without building deepspeed_shm_comm."""
    import torch.distributed as dist
    import deepspeed
    import deepspeed.ops
    from fpemu.adapters.torch_amp import _ensure_process_group
    _ensure_process_group(dist)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


@contextlib.contextmanager
def _fp16_on_this_cpu():
    """Let the engine take fp16 on a CPU whose oneDNN has no fp16 kernels; yields whether it had to.

    DeepSpeed's CPU accelerator answers ``is_fp16_supported()`` from
    ``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` (AVX512-FP16 or AMX-FP16), and the
    engine refuses fp16 when it is False.  torch computes fp16 on any CPU; the answer
    gates nothing else on the path driven here (the engine's sanity check and the dtype
    list its gradient reducer checks), so it is True while an engine runs, and the run
    records that it was.
    """
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        yield False
        return
    accelerator.is_fp16_supported = lambda: True
    try:
        yield True
    finally:
        del accelerator.is_fp16_supported


def _stable_counter(cur_iter, last_overflow_iter, window):
    """Good steps counted towards the next growth after an update, for the rule of 0.17.1 on (and of
    FP16_Optimizer in every version): grow when ``(cur_iter - last_overflow_iter) - 1`` is a
    positive multiple of the window (``cur_iter`` before its increment)."""
    return max(cur_iter - last_overflow_iter - 2, 0) % window


def _window_counter(cur_iter, last_overflow_iter, window):
    """The same for DynamicLossScaler up to 0.17.0: grow when ``cur_iter - last_overflow_iter`` is a
    multiple of the window."""
    return (cur_iter - last_overflow_iter - 1) % window


def _version():
    import deepspeed
    return deepspeed.__version__


def _growth_rule():
    """Which profile the loaded DynamicLossScaler follows, from what it does.  PR #6976 (merged after
    version.txt said 0.17.1) moved growth one good step later and fixed the factor at 2, removing the
    scale_factor argument.  With a window of 1 the older rule grows on the first good step
    ((0 - -1) % 1 == 0); the newer one's stable interval is 0 there, so it does not."""
    import inspect
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    probe = DynamicLossScaler(init_scale=1.0, scale_window=1, min_scale=1, delayed_shift=1,
                              consecutive_hysteresis=False)
    probe.update_scale(False)
    grows_at_once = probe.cur_scale != 1.0
    takes_factor = "scale_factor" in inspect.signature(DynamicLossScaler).parameters
    if grows_at_once != takes_factor:
        raise RuntimeError(f"this DynamicLossScaler {'grows' if grows_at_once else 'does not grow'} on the first "
                           f"good step of a window of 1 but {'takes' if takes_factor else 'has no'} scale_factor: "
                           f"neither the deepspeed profile nor deepspeed_0_17 models it")
    return "deepspeed_0_17" if grows_at_once else "deepspeed"


def _ends_training(step: int, error: Exception) -> list:
    """[step, message] for the raises that are DeepSpeed's own way of ending training: a bare
    Exception at the minimum scale, OverflowError from int(inf) in its log line once the scale is
    inf.  Anything else (an API change, a bug) propagates and is reported as the job's failure."""
    if type(error) not in (Exception, OverflowError):
        raise error
    return [step, f"{type(error).__name__}: {error}"]


def loss_scaler_read_back(scaler, profile: str) -> dict:
    """The ``profile``'s parameters as DeepSpeed holds them: a DynamicLossScaler, or FP16_Optimizer's
    state (its LossScaleConfig from 0.17.1 on, the optimizer itself before), whose attributes carry the
    profile's names; ``init_scale`` is ``cur_scale``, so read it before the first update."""
    return {name: getattr(scaler, "cur_scale" if name == "init_scale" else name)
            for name in get_profile(profile).defaults}


def _drive_loss_scaler(overflows, kwargs, profile):
    """DeepSpeed's DynamicLossScaler(**kwargs) through ``overflows``; stops where it raises."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    _deepspeed_comm()
    counter = _stable_counter if profile == "deepspeed" else _window_counter
    scaler = DynamicLossScaler(**kwargs)
    read_back = loss_scaler_read_back(scaler, profile)
    scales, applied, counters, hysteresis, raised = [], [], [], [], None
    for step, overflow in enumerate(overflows):
        scales.append(float(scaler.cur_scale))
        try:
            scaler.update_scale(overflow)
        except Exception as error:  # noqa: BLE001 -- narrowed by _ends_training
            raised = _ends_training(step, error)
        applied.append(not overflow and raised is None)
        counters.append(counter(scaler.cur_iter, scaler.last_overflow_iter, scaler.scale_window))
        hysteresis.append(scaler.cur_hysteresis)
        if raised:
            break
    return dict(scales=scales, applied=applied, counters=counters, hysteresis=hysteresis,
                final_scale=float(scaler.cur_scale), raised=raised, read_back=read_back)


_TINY_X = (1.0, 0.5, 0.25, 0.125)  # powers of two: every update below is exact in fp16


def _engine(torch, deepspeed, zero_stage, fp16, lr, gradient_clipping):
    model = torch.nn.Linear(len(_TINY_X), 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    config = {"train_batch_size": 1, "fp16": {"enabled": True, **fp16},
              "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True}
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                                      config=config)
    return engine


def _start_engine_process():
    # The engine asserts that a launcher set LOCAL_RANK; in a world of one it is 0.
    os.environ.setdefault("LOCAL_RANK", "0")
    return _deepspeed_comm()


@functools.lru_cache(maxsize=None)
def _host_engine():
    """An engine for FP16_Optimizer's ``deepspeed`` argument (0.17.0 reads it unconditionally)."""
    import torch
    deepspeed = _start_engine_process()
    with _fp16_on_this_cpu():
        return _engine(torch, deepspeed, 0, {}, 1.0, 0.0)


def _drive_fp16_optimizer(overflows, kwargs):
    """FP16_Optimizer built as the engine builds it (deepspeed=engine), with one fp16 parameter
    whose scaled gradient is set to inf or 1.0 each step."""
    import torch
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.utils.timer import NoopTimer
    engine = _host_engine()
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.half))
    inner = torch.optim.SGD([param], lr=1.0)
    args = {"init_scale": kwargs["init_scale"], "scale_window": kwargs["scale_window"],
            "min_scale": kwargs["min_loss_scale"]}
    optimizer = FP16_Optimizer(inner, deepspeed=engine, dynamic_loss_scale=True, dynamic_loss_args=args,
                               verbose=False, timers=NoopTimer())  # 0.17.0 calls its timers unconditionally
    state = getattr(optimizer, "loss_scale_config", optimizer)  # 0.17.1 on keep it in a LossScaleConfig
    read_back = loss_scaler_read_back(state, "deepspeed_fp16_optimizer")
    calls = []
    real_step = inner.step
    inner.step = lambda *a, **k: (calls.append(True), real_step(*a, **k))[1]
    scales, applied, counters = [], [], []
    for overflow in overflows:
        scales.append(float(state.cur_scale))
        param.grad = torch.full_like(param, float("inf") if overflow else 1.0)
        before = len(calls)
        optimizer.step()
        applied.append(len(calls) > before)
        counters.append(_stable_counter(state.cur_iter, state.last_overflow_iter, state.scale_window))
    return dict(scales=scales, applied=applied, counters=counters, final_scale=float(state.cur_scale),
                read_back=read_back)


def _drive_engine(steps, overflow_steps, zero_stage, fp16, lr, gradient_clipping):
    import torch
    deepspeed = _start_engine_process()
    x = torch.tensor([_TINY_X], dtype=torch.half)
    correct = [-lr * v for v in _TINY_X]  # -lr * d(w.x)/dw: the update of a rightly unscaled gradient
    scales, skipped, updates, raised = [], [], [], None
    with _fp16_on_this_cpu() as overridden:
        engine = _engine(torch, deepspeed, zero_stage, fp16, lr, gradient_clipping)
        # ZeRO 1/2 keep a DynamicLossScaler; ZeRO 0's FP16_UnfusedOptimizer its LossScaleConfig (0.17.1 on)
        read_back = (loss_scaler_read_back(engine.optimizer.loss_scaler, "deepspeed") if zero_stage else
                     loss_scaler_read_back(getattr(engine.optimizer, "loss_scale_config", engine.optimizer),
                                           "deepspeed_fp16_optimizer"))
        for step in range(steps):
            before = engine.module.weight.detach().double().flatten()
            scales.append(float(engine.optimizer.loss_scale))
            loss = engine(x).float().sum() * (float("inf") if step in overflow_steps else 1.0)
            engine.backward(loss)
            try:
                engine.step()
            except Exception as error:  # noqa: BLE001 -- narrowed by _ends_training
                raised = _ends_training(step, error)
            skipped.append(raised is not None or not engine.was_step_applied())
            updates.append((engine.module.weight.detach().double().flatten() - before).tolist())
            if raised:
                break
    return dict(version=deepspeed.__version__, optimizer=type(engine.optimizer).__name__, read_back=read_back,
                scales=scales, skipped=skipped, updates=updates, correct=correct,
                final_scale=float(engine.optimizer.loss_scale), fp16_probe_overridden=overridden, raised=raised)


_CALLS = {"version": _version, "growth_rule": _growth_rule, "loss_scaler": _drive_loss_scaler, "fp16_optimizer": _drive_fp16_optimizer,
          "engine": _drive_engine}


def _serve():
    """The worker: one JSON request per line on stdin, one JSON answer per line on the original stdout."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # DeepSpeed logs and prints to stdout; they go to stderr, the answers keep their pipe
    import logging
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = {"ok": _CALLS[request["call"]](**request["args"])}
        except Exception as error:  # reported to the caller, which raises it there
            answer = {"error": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps(answer) + "\n")


# --- the caller's side ----------------------------------------------------------

CALL_TIMEOUT = 600.0  # seconds for one request: the engine's first start takes a few


class _Worker:
    def __init__(self, tree: Optional[str]):
        self.tree = tree
        self.log = tempfile.TemporaryFile(mode="w+")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
        boot = ("import sys; tree = sys.argv[1]; tree and sys.path.insert(0, tree); "
                "from fpemu.adapters.deepspeed_scaler import _serve; _serve()")
        self.process = subprocess.Popen([sys.executable, "-c", boot, tree or ""], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.version = self.call("version")
        self.profile = self.call("growth_rule")

    def call(self, name, timeout: float = CALL_TIMEOUT, **args):
        """One request; a hang (gloo, an op build) is a TimeoutError and a dead worker, never a stuck run.
        The worker's TypeError and AttributeError come back as themselves (an API change)."""
        where = f"DeepSpeed worker ({self.tree or 'installed'})"
        if self.process.poll() is not None:
            raise RuntimeError(f"{where} has exited: {self._log_tail()}")
        self.process.stdin.write(json.dumps({"call": name, "args": args}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            self.process.kill()
            self.process.wait()
            raise TimeoutError(f"{where}: no answer to {name} within {timeout:g} s (killed): {self._log_tail()}")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{where} died during {name}: {self._log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            kind = answer["error"].partition(":")[0]
            raise {"TypeError": TypeError, "AttributeError": AttributeError}.get(kind, RuntimeError)(
                f"{where}, {name}: {answer['error']}")
        return answer["ok"]

    def _log_tail(self):
        self.log.seek(0)
        return self.log.read()[-2000:]

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


_WORKERS = {}


@atexit.register
def _close_workers():
    while _WORKERS:
        _WORKERS.popitem()[1].close()


def _worker(tree: Optional[str]) -> _Worker:
    if tree is not None and _tree_missing(tree):
        raise RuntimeError(tree_0_17_unavailable() if tree == tree_0_17() else f"no DeepSpeed tree at {tree}")
    if tree not in _WORKERS or _WORKERS[tree].process.poll() is not None:  # a killed one is replaced
        _WORKERS[tree] = _Worker(tree)
    return _WORKERS[tree]


def deepspeed_version(tree: Optional[str] = None) -> str:
    """The version of the installed DeepSpeed (tree None) or of the tree at ``tree``."""
    return _worker(tree).version


def _check_device(device):
    if device != "cpu":
        raise ValueError(f"device: the DeepSpeed adapters run DeepSpeed's CPU accelerator only, got {device!r}")


def _plain(params):
    """params with numpy scalars as Python numbers (they travel as JSON)."""
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in params.items()}


def _scaler_trace(profile, params, overflows, observed):
    steps = len(observed["scales"])  # fewer than the flags where DeepSpeed raised
    trace = observed_trace(profile, params, overflows[:steps], observed["scales"], observed["applied"],
                           observed["counters"], observed["final_scale"], read_back=observed["read_back"])
    raised = observed["raised"]
    return dataclasses.replace(trace, hysteresis=observed["hysteresis"],
                               stopped_at=raised[0] if raised else None,
                               events=[tuple(raised)] if raised else [])


def _record_loss_scaler(overflows, params, device, tree, class_defaults):
    _check_device(device)
    worker = _worker(tree)
    profile = worker.profile
    if class_defaults:
        if profile != "deepspeed_0_17":
            raise RuntimeError(f"DeepSpeed {worker.version}'s DynamicLossScaler has no defaults (PR #6976)")
        profile = "deepspeed_legacy"
    get_profile(profile).rules(**params)  # bad parameters are refused here, with their names
    # The engine passes every argument from its config; with class defaults only the given ones go.
    kwargs = _plain(params if class_defaults else {**get_profile(profile).defaults, **params})
    observed = worker.call("loss_scaler", overflows=list(overflows), kwargs=kwargs, profile=profile)
    return _scaler_trace(profile, params, overflows, observed)


def record_deepspeed(overflows, params, device):
    """The installed DeepSpeed's DynamicLossScaler, with the engine's config defaults."""
    return _record_loss_scaler(overflows, params, device, None, class_defaults=False)


def record_deepspeed_0_17(overflows, params, device):
    """DeepSpeed 0.17.0's DynamicLossScaler (the tree), with the engine's config defaults."""
    return _record_loss_scaler(overflows, params, device, tree_0_17(), class_defaults=False)


def record_deepspeed_legacy(overflows, params, device):
    """DeepSpeed 0.17.0's DynamicLossScaler with its class defaults (what its ZeRO built from a bare
    fp16 config)."""
    return _record_loss_scaler(overflows, params, device, tree_0_17(), class_defaults=True)


def _record_fp16_optimizer(overflows, params, device, tree):
    _check_device(device)
    profile = get_profile("deepspeed_fp16_optimizer")
    profile.rules(**params)
    observed = _worker(tree).call("fp16_optimizer", overflows=list(overflows),
                                  kwargs=_plain({**profile.defaults, **params}))
    return observed_trace(profile.name, params, overflows, observed["scales"], observed["applied"],
                          observed["counters"], observed["final_scale"], read_back=observed["read_back"])


def record_deepspeed_fp16_optimizer(overflows, params, device):
    """The installed DeepSpeed's FP16_Optimizer (its _update_scale)."""
    return _record_fp16_optimizer(overflows, params, device, None)


def record_deepspeed_fp16_optimizer_0_17(overflows, params, device):
    """DeepSpeed 0.17.0's FP16_Optimizer (the tree)."""
    return _record_fp16_optimizer(overflows, params, device, tree_0_17())


# --- the engine -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EngineRun:
    """What ``deepspeed.initialize``'s engine did to a tiny fp16 model, step by step.

    The model is one ``Linear(4, 1, bias=False)`` from zero weights, the loss ``w . x`` with
    ``x = (1, 1/2, 1/4, 1/8)`` (times inf on an overflow step), torch SGD.

    Attributes:
      version: the DeepSpeed that ran.
      zero_stage: the ZeRO stage.
      optimizer: the class DeepSpeed wrapped the optimizer in.
      scales: the loss scale DeepSpeed reported before each step.
      skipped: per step, whether the engine skipped the update.
      updates: per step, the change of the fp16 weights, float64 (exact: fp16 differences).
      correct: the update a rightly unscaled gradient gives, ``-lr * x``.
      ratios: per step, applied update / correct update (None for a skipped step); 1.0 is right.
      final_scale: the loss scale after the last step.
      fp16_probe_overridden: the CPU accelerator's fp16 probe was answered True for the run
        (see ``_fp16_on_this_cpu``).
      raised: [step, message] where the engine raised (its scaler at the minimum scale) and the
        run ended, else None.
      read_back: the profile's parameters as the engine holds them before the first step (ZeRO 1/2's
        DynamicLossScaler: ``deepspeed``; ZeRO 0's FP16_UnfusedOptimizer: ``deepspeed_fp16_optimizer``).
    """

    version: str
    zero_stage: int
    optimizer: str
    scales: list
    skipped: list
    updates: np.ndarray
    correct: np.ndarray
    ratios: list
    final_scale: float
    fp16_probe_overridden: bool
    raised: Optional[list] = None
    read_back: Optional[dict] = None


def run_engine(steps: int, overflow_steps: Sequence[int] = (), zero_stage: int = 1, *,
               initial_scale_power: int = 4, loss_scale_window: int = 2, hysteresis: int = 1,
               gradient_clipping: Optional[float] = 0.0, lr: float = 2.0**-4,
               tree: Optional[str] = None, **fp16_config) -> EngineRun:
    """Train the tiny model for ``steps`` steps through DeepSpeed's engine (fp16, a world of one).

    Args:
      steps: how many steps.
      overflow_steps: the steps whose loss is multiplied by inf.
      zero_stage: 0, 1 or 2.
      initial_scale_power, loss_scale_window, hysteresis: the fp16 config; the default scale
        of 2^4 keeps the scaled fp16 gradients finite.
      gradient_clipping: the config's ``gradient_clipping``; None leaves it out (DeepSpeed's
        default then applies).
      lr: SGD's learning rate; a power of two keeps the updates exact.
      tree: None for the installed DeepSpeed, or a DeepSpeed tree such as :func:`tree_0_17`.
      **fp16_config: more keys of the fp16 config (``min_loss_scale``, ``consecutive_hysteresis``).
    """
    for name, value in (("steps", steps), ("zero_stage", zero_stage), ("initial_scale_power", initial_scale_power),
                        ("loss_scale_window", loss_scale_window), ("hysteresis", hysteresis)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage}")
    if loss_scale_window < 1 or hysteresis < 1:
        raise ValueError(f"loss_scale_window and hysteresis must be at least 1, got {loss_scale_window}, {hysteresis}")
    bad = [s for s in overflow_steps if isinstance(s, bool) or not isinstance(s, (int, np.integer))
           or not 0 <= s < steps]
    if bad:
        raise ValueError(f"overflow_steps must be step indices in [0, {steps}), got {bad}")
    fp16 = {"initial_scale_power": int(initial_scale_power), "loss_scale_window": int(loss_scale_window),
            "hysteresis": int(hysteresis), **_plain(fp16_config)}
    ran = _worker(tree).call("engine", steps=int(steps), overflow_steps=sorted({int(s) for s in overflow_steps}),
                             zero_stage=int(zero_stage), fp16=fp16, lr=float(lr),
                             gradient_clipping=None if gradient_clipping is None else float(gradient_clipping))
    updates = np.array(ran["updates"], dtype=np.float64)
    correct = np.array(ran["correct"], dtype=np.float64)
    ratios = [None if skip else float(update[0] / correct[0]) for skip, update in zip(ran["skipped"], updates)]
    return EngineRun(ran["version"], zero_stage, ran["optimizer"], ran["scales"], ran["skipped"], updates,
                     correct, ratios, ran["final_scale"], ran["fp16_probe_overridden"], ran["raised"], ran["read_back"])


# --- the engine as a scaler adapter ----------------------------------------------

def _engine_config(profile: str, params: dict) -> dict:
    """A profile's parameters as the engine's fp16 config, which takes a scale power of two and has
    no switch for raising at the floor.  ZeRO-0 (FP16_UnfusedOptimizer) follows FP16_Optimizer's rule
    (``deepspeed_fp16_optimizer``: no hysteresis, a floor without raising); ZeRO-1/2 DynamicLossScaler's."""
    merged = {**get_profile(profile).defaults, **params}
    get_profile(profile).rules(**params)
    # (frexp, exact: log2 rounds 2**20 * (1 + 2**-52) to 20.0)
    significand, exponent = math.frexp(merged["init_scale"])
    if significand != 0.5:
        raise ValueError(f"init_scale: the engine's fp16 config takes initial_scale_power, so init_scale must "
                         f"be a power of two, got {merged['init_scale']!r}")
    config = {"initial_scale_power": exponent - 1, "loss_scale_window": merged["scale_window"]}
    if profile == "deepspeed_fp16_optimizer":
        return {**config, "min_loss_scale": merged["min_loss_scale"]}
    if merged["raise_error_at_min_scale"] is not True:
        raise ValueError("raise_error_at_min_scale: the engine's fp16 config has no such key (it always raises)")
    return {**config, "hysteresis": merged["delayed_shift"], "min_loss_scale": merged["min_scale"],
            "consecutive_hysteresis": merged["consecutive_hysteresis"]}


def _record_engine(overflows, params, device, zero_stage):
    """The installed DeepSpeed's engine (fp16, a world of one) through the overflow flags: the scale
    it reports, whether it skipped, and the update it applied against the right one.  The engine
    does not expose a growth counter."""
    _check_device(device)
    profile = "deepspeed_fp16_optimizer" if zero_stage == 0 else scaler_profile()
    run = run_engine(len(overflows), [i for i, o in enumerate(overflows) if o], zero_stage,
                     **_engine_config(profile, params))
    ratios = [0.0 if ratio is None else ratio for ratio in run.ratios]
    trace = observed_trace(profile, params, overflows[:len(run.scales)], run.scales,
                           [not s for s in run.skipped], None, run.final_scale, update_ratio=ratios,
                           read_back=run.read_back)
    if run.raised is None:
        return trace
    return dataclasses.replace(trace, stopped_at=run.raised[0], events=[tuple(run.raised)])


def record_deepspeed_zero0(overflows, params, device):
    return _record_engine(overflows, params, device, 0)


def record_deepspeed_zero1(overflows, params, device):
    return _record_engine(overflows, params, device, 1)


def record_deepspeed_zero2(overflows, params, device):
    return _record_engine(overflows, params, device, 2)
