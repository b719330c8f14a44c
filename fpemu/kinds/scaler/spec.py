"""Scaler scenarios: a loss scaler profile driven through one overflow flag per step.

A scaler spec (one scenario per file)::

    name = "torch-growth-timing"          # optional, defaults to the file name
    description = "GradScaler grows on the N-th good step"
    steps = 16

    [scaler]
    profile = "torch"
    params = { init_scale = 16.0, growth_interval = 3 }

    [overflow]
    source = "explicit"                   # explicit | bernoulli | bursts | periodic | model | recorded
    sequence = [false, false, false, true]

    [record]
    fields = ["scale", "overflow", "applied", "growth_counter"]

    [implementations.torch]               # drive the real GradScaler (params default to the scaler's)
    [implementations.flax]
    params = { scale = 16.0, growth_interval = 3 }
    expect_divergence = { step = 2, field = "growth_counter", reason = "flax grows on the (N+1)-th good step" }

The overflow flags come from an explicit list, a seeded random process, a model trained in an
emulated format, or a recorded run's gradients replayed; overflow sources are pure: the same
scenario always yields the same flags.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from fpemu.adapters import SCALER, get_adapter
from fpemu.errors import FpemuInputError
from fpemu.kinds.scenario import Implementation, ScenarioBase
from fpemu.kinds.schema import Checker, build_scenario, implementation_tables, record_fields
from fpemu.scalers.profiles import PROFILES, get_profile
from fpemu.traces.fields import OBSERVED_FIELDS

MODELS = ("linear", "mlp")
MODEL_COMPUTE = ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")
_SOURCE_KEYS = {
    "explicit": {"sequence"},
    "bernoulli": {"rate", "seed"},
    "bursts": {"rate", "seed", "length"},
    "periodic": {"period", "offset", "length"},
    "model": {"model", "seed", "compute", "lr", "target_scale"},
    "recorded": {"trace", "compute", "sha256"},  # a recorded run's gradients, replayed (fpemu.traces.replay)
}


OVERFLOW_SOURCES = ("explicit", "bernoulli", "bursts", "periodic", "model", "recorded")


@dataclasses.dataclass(frozen=True)
class OverflowSource:
    """Where a scenario's overflow flags come from.

    Attributes:
      kind: one of ``explicit``, ``bernoulli``, ``bursts``, ``periodic``, ``model``.
      sequence: the flags, for ``explicit``.
      rate: per-step overflow probability (``bernoulli``) or burst-start probability (``bursts``).
      seed: seed of the random processes and of the model's data.
      length: burst length (``bursts``) or overflowing steps per period (``periodic``).
      period, offset: ``periodic``: steps ``offset, offset + period, ...`` start an overflow run.
      model: ``linear`` or ``mlp`` for ``model``; compute: the emulated compute format;
        lr and target_scale: the model's learning rate and the size of its targets (and
        so of its gradients).
      trace: ``recorded``: the recorded run's trace file, whose gradients are replayed (see
        fpemu.traces.replay); compute is then the format the replay decides overflows in, and
        sequence the run's own overflow verdicts.
      trace_sha256: ``recorded``: the sha256 of the trace file as loaded (traces made from the
        scenario record it, so a golden replayed from another version of the file is refused).
    """

    kind: str
    sequence: tuple = ()
    rate: float = 0.0
    seed: int = 0
    length: int = 1
    period: int = 1
    offset: int = 0
    model: str = "linear"
    compute: str = "fp16"
    lr: float = 0.05
    target_scale: float = 1e-3
    trace: str = ""
    trace_sha256: str = ""

    def flags(self, steps: int) -> np.ndarray:
        """The overflow flag of each of ``steps`` steps (not for ``model``, which needs the scaler)."""
        if self.kind == "explicit":
            return np.array(self.sequence[:steps], dtype=bool)
        rng = np.random.default_rng(self.seed)
        if self.kind == "bernoulli":
            return rng.random(steps) < self.rate
        flags = np.zeros(steps, dtype=bool)
        if self.kind == "bursts":
            starts = np.flatnonzero(rng.random(steps) < self.rate)
        elif self.kind == "periodic":
            starts = np.arange(self.offset, steps, self.period)
        else:
            raise ValueError(f"overflow source {self.kind!r} is decided by the scaler's scale, not by a flag list")
        for start in starts:
            flags[start:start + self.length] = True
        return flags


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalerScenario(ScenarioBase):
    """A loss scaler profile driven through overflow flags (see :func:`fpemu.specs.load_spec`)."""

    profile: str
    params: dict
    overflow: OverflowSource

    def implementation(self, name: str) -> Implementation:
        """The implementation ``name`` as this scenario drives it: its own table, else the scaler's
        parameters for the profile's own adapter, else the adapter's defaults."""
        own = get_adapter(name).profile == self.profile
        return self.declared(name) or Implementation(name, dict(self.params) if own else {})


def overflow_source(check: Checker, raw, table: str = "overflow") -> OverflowSource:
    """The overflow source of the table at ``table`` (``overflow``, a rank's ``ranks.overflow.1``), errors naming
    its keys there."""
    kind = check.source(raw, table, OVERFLOW_SOURCES, _SOURCE_KEYS)
    fields = {"kind": kind}
    if kind == "explicit":
        sequence = raw.get("sequence")
        if not isinstance(sequence, list) or not all(isinstance(v, bool) for v in sequence):
            check.fail(f"{table}.sequence", "expected a list of true/false")
        fields["sequence"] = tuple(sequence)
    if "rate" in raw or kind in ("bernoulli", "bursts"):
        fields["rate"] = check.number(raw.get("rate"), f"{table}.rate", 0.0, 1.0)
    if "seed" in raw:
        fields["seed"] = check.integer(raw["seed"], f"{table}.seed", 0)
    if "length" in raw:
        fields["length"] = check.integer(raw["length"], f"{table}.length", 1)
    if kind == "periodic":
        fields["period"] = check.integer(raw.get("period"), f"{table}.period", 1)
        fields["offset"] = check.integer(raw.get("offset", 0), f"{table}.offset", 0)
    if kind == "model":
        fields["model"] = check.choice(raw.get("model", "linear"), f"{table}.model", MODELS)
        fields["compute"] = check.choice(raw.get("compute", "fp16"), f"{table}.compute", MODEL_COMPUTE)
        fields["lr"] = check.number(raw.get("lr", 0.05), f"{table}.lr", 1e-12, 1e6)
        fields["target_scale"] = check.number(raw.get("target_scale", 1e-3), f"{table}.target_scale", 1e-30, 1e30)
    if kind == "recorded":
        fields.update(_recorded_source(check, raw, table))
    return OverflowSource(**fields)


def _recorded_source(check: Checker, raw, table: str) -> dict:
    """The trace file (relative to the spec's folder), its sha256 (checked against ``sha256`` where
    the spec pins one) and the replay's format (default: the run's)."""
    from fpemu.traces.replay import file_sha256, pinned_sha256_problem
    from fpemu.traces import read_trace
    from fpemu.traces.recorded import recorded_steps, recorder_settings
    trace_path = pathlib.Path(check.path).parent / check.string(raw.get("trace"), f"{table}.trace")
    try:
        trace = read_trace(trace_path)
        verdicts = tuple(step.overflow for step in recorded_steps(trace, str(trace_path)))
        recorded_format = recorder_settings(trace, str(trace_path)).compute_format
    except FpemuInputError as error:
        check.fail(f"{table}.trace", str(error))
    sha256 = file_sha256(trace_path)
    if "sha256" in raw:
        problem = pinned_sha256_problem(trace_path, sha256, check.string(raw["sha256"], f"{table}.sha256"))
        if problem:
            check.fail(f"{table}.sha256", problem)
    compute = check.choice(raw.get("compute", recorded_format), f"{table}.compute", MODEL_COMPUTE)
    return {"trace": str(trace_path), "compute": compute, "sequence": verdicts, "trace_sha256": sha256}


def profile_params(check: Checker, profile: str, params, key: str) -> dict:
    if not isinstance(params, dict):
        check.fail(key, f"expected a table, got {type(params).__name__}")
    for name, value in params.items():
        check.parameter(value, f"{key}.{name}")
    try:
        get_profile(profile).rules(**params)
    except (TypeError, ValueError) as error:
        check.fail(key, str(error))
    return dict(params)


def _implementations(check: Checker, raw, profile: str, params: dict) -> tuple:
    out = []
    for key, adapter, device, body, reason in implementation_tables(check, raw, SCALER):
        adapter_profile = get_adapter(adapter).profile
        if "params" in body:
            impl_params = profile_params(check, adapter_profile, body["params"], f"{key}.params")
        elif adapter_profile == profile:
            impl_params = dict(params)
        else:
            check.fail(f"{key}.params", f"required: {adapter} runs under another profile than {profile}")
        out.append(Implementation(adapter, impl_params, device, reason))
    return tuple(out)


def _check_observable(check: Checker, fields: tuple, implementations: tuple) -> None:
    """Every declared implementation records at least one of the fields the spec records (the
    DeepSpeed engine rows, say, have no growth counter)."""
    for impl in implementations:
        observable = get_adapter(impl.name).fields
        if not set(fields) & set(observable):
            check.fail(f"implementations.{impl.name}", f"records none of record.fields ({', '.join(fields)}); "
                                                      f"it records {', '.join(observable)}")


def _scaler(check: Checker, raw) -> tuple:
    scaler = check.table(raw, "scaler", {"profile", "params"})
    profile = check.choice(scaler.get("profile"), "scaler.profile", tuple(PROFILES))
    return profile, profile_params(check, profile, scaler.get("params", {}), "scaler.params")


def _check_overflow_fits(check: Checker, overflow: OverflowSource, steps, profile, params) -> None:
    if (overflow.kind in ("model", "recorded") and profile is not None
            and get_profile(profile).rules(**params).pass_after_consecutive is not None):
        driven_by = "model-driven" if overflow.kind == "model" else "recorded"
        check.fail("overflow.source", f"a {driven_by} source needs a scaler that skips every non-finite step; "
                                      f"{profile} lets some through")
    if overflow.kind == "explicit" and steps is not None and len(overflow.sequence) != steps:
        check.fail("overflow.sequence", f"expected steps={steps} flags, got {len(overflow.sequence)}")
    if overflow.kind == "recorded" and steps is not None and len(overflow.sequence) < steps:
        check.fail("steps", f"the recorded run {overflow.trace} has {len(overflow.sequence)} attempts, "
                            f"fewer than steps={steps}")


def parse_scaler_spec(check: Checker, raw: dict, text: str, path: str) -> ScalerScenario:
    """Validate a scaler spec (``check``: the loader's checker, which names the file); every independent
    mistake is reported at once."""
    for required in ("steps", "scaler", "overflow"):
        if required not in raw:
            check.attempt(check.fail, required, "missing required key")
    if isinstance(raw.get("overflow"), dict) and raw["overflow"].get("source") == "model":
        check.kind = "model"  # a model-driven spec's steps train a model: its own bounds (fpemu.kinds.bounds)
    steps = check.attempt(check.integer, raw["steps"], "steps", 1) if "steps" in raw else None
    profile, params = (check.attempt(_scaler, check, raw["scaler"]) if "scaler" in raw else None) or (None, None)
    overflow = check.attempt(overflow_source, check, raw["overflow"]) if "overflow" in raw else None
    fields = implementations = None  # (left None only where an error is recorded)
    if overflow is not None:
        check.attempt(_check_overflow_fits, check, overflow, steps, profile, params)
        fields = check.attempt(record_fields, check, raw, "model" if overflow.kind == "model" else "scaler")
        if fields is not None and not set(fields) & set(OBSERVED_FIELDS):
            check.attempt(check.fail, "record.fields", f"record at least one of {', '.join(OBSERVED_FIELDS)}: "
                                                       "the real implementations are compared on those")
    if profile is not None:
        implementations = check.attempt(_implementations, check, raw.get("implementations", {}), profile, params)
    if fields is not None and implementations is not None:
        check.attempt(_check_observable, check, fields, implementations)
    check.raise_errors()
    return build_scenario(check, ScalerScenario, raw, text, path, steps=steps, profile=profile, params=params,
                     overflow=overflow, implementations=implementations, record=fields)
