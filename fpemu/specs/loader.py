"""Load TOML scenario specs; every error names the file, the key and what was expected.

A spec (one scenario per file)::

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import pathlib
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fpemu.errors import FpemuInputError
from fpemu.fileio import read_bounded
from fpemu.scalers.profiles import PROFILES, get_profile
from fpemu.steps.semantics import get_semantics
from fpemu.steps.step import checked_compute
from fpemu.traces.format import EXACT_FIELDS, OBSERVED_FIELDS, ULP_FIELDS, fields_recorded_by
from fpemu.specs.bounds import MAX_SPEC_BYTES, bound_for
from fpemu.specs.recipes import RecipeScenario
from fpemu.specs.scenario import (OVERFLOW_SOURCES, ExpectedDivergence, Implementation, OverflowSource,
                                  ScalerScenario, StepScenario, StepSource)

MODELS = ("linear", "mlp")
MODEL_COMPUTE = ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")

_TOP_KEYS = {"name", "description", "steps", "scaler", "overflow", "record", "implementations", "step",
              "recipe", "amax", "ranks", "fp8_training", "blocks"}  # [recipe] and [amax]: fpemu.specs.recipes; [ranks]: fpemu.specs._ranks
# [fp8_training]: fpemu.specs.fp8_training; [blocks]: fpemu.specs.blocks
# Scenario kinds beyond scaler and step specs: the top-level table that marks one -> its parser
# ("module:function", taking (checker, raw TOML, text, path)).
SCENARIO_KINDS = {"ranks": "fpemu.specs._ranks:parse_ranks_spec", "recipe": "fpemu.specs.recipes:parse_recipe_spec",
                  "fp8_training": "fpemu.specs.fp8_training:parse_fp8_training_spec",
                  "blocks": "fpemu.specs.blocks:parse_blocks_spec"}
STEP_MODES = ("jax_cpu_strict", "jax_cpu", "torch_cpu", "torch_cpu_grad_scaler", "torch_cpu_compiled", "seed")
_SOURCE_KEYS = {
    "explicit": {"sequence"},
    "bernoulli": {"rate", "seed"},
    "bursts": {"rate", "seed", "length"},
    "periodic": {"period", "offset", "length"},
    "model": {"model", "seed", "compute", "lr", "target_scale"},
    "recorded": {"trace", "compute", "sha256"},  # a recorded run's gradients, replayed (fpemu.traces.replay)
}


class SpecError(FpemuInputError):
    """A spec file that cannot be used; the message names the file and the key."""


def _short(value) -> str:
    """``repr(value)``, cut to a readable length (a huge literal is named, not printed)."""
    big = isinstance(value, int) and value.bit_length() > 100
    text = f"an integer of {value.bit_length()} bits" if big else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Checker:
    """Validation helpers that name the file and the key.  ``fail`` stops a check; ``attempt``
    runs one independent part of the spec and records its failure, so a spec's independent
    mistakes are all reported at once by ``raise_errors``."""

    def __init__(self, path: str):
        self.path = path
        self.errors = []
        self.kind = ""  # the scenario kind, once known: some bounds differ by kind (fpemu.specs.bounds)

    def fail(self, key: str, message: str):
        raise SpecError(f"{self.path}: {key}: {message}")

    def attempt(self, check, *args):
        """``check(*args)``, or None when it fails (the failure is kept for ``raise_errors``)."""
        try:
            return check(*args)
        except SpecError as error:
            self.errors.append(str(error))
            return None

    def raise_errors(self) -> None:
        if self.errors:
            raise SpecError("\n".join(self.errors))

    def table(self, value, key: str, allowed) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"expected a table, got {type(value).__name__}")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                      f"unknown key; allowed keys: {', '.join(sorted(allowed))}")
        return value

    def integer(self, value, key: str, minimum: int) -> int:
        """An integer >= ``minimum`` and within the bound of ``key`` in fpemu.specs.bounds (before anything
        allocates or loops over it)."""
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {_short(value)}")
        if value < minimum:
            self.fail(key, f"expected an integer >= {minimum}, got {_short(value)}")
        return self.bounded(value, key)

    def parameter(self, value, key: str):
        """A scaler's or recipe's parameter: a number, true/false or a string (the model checks which), an
        integer within its row of fpemu.specs.bounds.BOUNDS."""
        if not isinstance(value, (int, float, str)):
            self.fail(key, f"expected a number, true/false or a string, got {_short(value)}")
        return self.bounded(value, key)

    def bounded(self, value, key: str):
        """``value``, or a failure naming ``key`` when it is an integer outside its row of
        fpemu.specs.bounds.BOUNDS (other values are left to the check that knows their kind)."""
        if isinstance(value, bool) or not isinstance(value, int):
            return value
        bound = bound_for(key)
        if not bound.minimum <= value <= bound.limit(self.kind):
            kind = f" for a {self.kind} spec" if isinstance(bound.maximum, dict) and self.kind else ""
            self.fail(key, f"expected an integer in {bound.minimum:,}..{bound.limit(self.kind):,}{kind} "
                           f"({bound.why}), got {_short(value)}")
        return value

    def number(self, value, key: str, low: float, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, f"expected a finite number, got {value!r}")
        if not low <= value <= high:
            self.fail(key, f"expected a number in [{low}, {high}], got {value}")
        return float(value)

    def choice(self, value, key: str, options) -> str:
        if value not in options:
            self.fail(key, f"expected one of {', '.join(options)}, got {value!r}")
        return value

    def string(self, value, key: str) -> str:
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {value!r}")
        return value

    def source(self, raw, table: str, options, keys_by_kind: dict) -> str:
        """The ``source`` of a [table] whose values come from one of ``options``; the table may
        hold that source's keys (``keys_by_kind[source]``) only."""
        if not isinstance(raw, dict) or "source" not in raw:
            self.fail(f"{table}.source", f"expected one of {', '.join(options)}")
        kind = self.choice(raw["source"], f"{table}.source", options)
        self.table(raw, table, keys_by_kind[kind] | {"source"})
        return kind


def _overflow_source(check: _Checker, raw) -> OverflowSource:
    kind = check.source(raw, "overflow", OVERFLOW_SOURCES, _SOURCE_KEYS)
    fields = {"kind": kind}
    if kind == "explicit":
        sequence = raw.get("sequence")
        if not isinstance(sequence, list) or not all(isinstance(v, bool) for v in sequence):
            check.fail("overflow.sequence", "expected a list of true/false")
        fields["sequence"] = tuple(sequence)
    if "rate" in raw or kind in ("bernoulli", "bursts"):
        fields["rate"] = check.number(raw.get("rate"), "overflow.rate", 0.0, 1.0)
    if "seed" in raw:
        fields["seed"] = check.integer(raw["seed"], "overflow.seed", 0)
    if "length" in raw:
        fields["length"] = check.integer(raw["length"], "overflow.length", 1)
    if kind == "periodic":
        fields["period"] = check.integer(raw.get("period"), "overflow.period", 1)
        fields["offset"] = check.integer(raw.get("offset", 0), "overflow.offset", 0)
    if kind == "model":
        fields["model"] = check.choice(raw.get("model", "linear"), "overflow.model", MODELS)
        fields["compute"] = check.choice(raw.get("compute", "fp16"), "overflow.compute", MODEL_COMPUTE)
        fields["lr"] = check.number(raw.get("lr", 0.05), "overflow.lr", 1e-12, 1e6)
        fields["target_scale"] = check.number(raw.get("target_scale", 1e-3), "overflow.target_scale", 1e-30, 1e30)
    if kind == "recorded":
        fields.update(_recorded_source(check, raw))
    return OverflowSource(**fields)


def _recorded_source(check: _Checker, raw) -> dict:
    """The trace file (relative to the spec's folder), its sha256 (checked against ``sha256`` where
    the spec pins one) and the replay's format (default: the run's)."""
    from fpemu.traces.replay import file_sha256, pinned_sha256_problem
    from fpemu.traces import read_trace
    from fpemu.traces.recorded import recorded_steps, recorder_settings
    trace_path = pathlib.Path(check.path).parent / check.string(raw.get("trace"), "overflow.trace")
    try:
        trace = read_trace(trace_path)
        verdicts = tuple(step.overflow for step in recorded_steps(trace, str(trace_path)))
        recorded_format = recorder_settings(trace, str(trace_path)).compute_format
    except FpemuInputError as error:
        check.fail("overflow.trace", str(error))
    sha256 = file_sha256(trace_path)
    if "sha256" in raw:
        problem = pinned_sha256_problem(trace_path, sha256, check.string(raw["sha256"], "overflow.sha256"))
        if problem:
            check.fail("overflow.sha256", problem)
    compute = check.choice(raw.get("compute", recorded_format), "overflow.compute", MODEL_COMPUTE)
    return {"trace": str(trace_path), "compute": compute, "sequence": verdicts, "trace_sha256": sha256}


def _profile_params(check: _Checker, profile: str, params, key: str) -> dict:
    if not isinstance(params, dict):
        check.fail(key, f"expected a table, got {type(params).__name__}")
    for name, value in params.items():
        check.parameter(value, f"{key}.{name}")
    try:
        get_profile(profile).rules(**params)
    except (TypeError, ValueError) as error:
        check.fail(key, str(error))
    return dict(params)


def _implementation_tables(check: _Checker, raw, kind: str):
    """Yield (key, adapter, device, body, declared divergence) for each [implementations.X] table
    naming an adapter of ``kind``."""
    from fpemu.adapters import resolve
    if not isinstance(raw, dict):
        check.fail("implementations", "expected a table of implementation tables")
    other = {"scaler": "[step]", "step": "scaler", "recipe": "scaler and [step]",
             "blocks": "scaler, [step] and [recipe]"}[kind]
    for name, body in raw.items():
        key = f"implementations.{name}"
        try:
            adapter, device = resolve(name, kind)
        except ValueError as wrong:
            check.fail(key, f"{wrong} (add @cuda to run on the GPU; the other adapters run {other} specs)")
        check.table(body, key, {"params", "expect_divergence"})
        yield key, adapter, device, body, _expected_divergence(check, body, key)


def _expected_divergence(check: _Checker, body: dict, key: str):
    if "expect_divergence" not in body:
        return None
    key = f"{key}.expect_divergence"
    raw = check.table(body["expect_divergence"], key, {"step", "field", "reason"})
    for required in ("step", "field", "reason"):
        if required not in raw:
            check.fail(f"{key}.{required}", "missing required key (a declared divergence names its first "
                                            "divergent step and field, and why)")
    return ExpectedDivergence(step=check.integer(raw["step"], f"{key}.step", 0),
                              field=check.choice(raw["field"], f"{key}.field", EXACT_FIELDS + ULP_FIELDS + ("steps",)),
                              reason=check.string(raw["reason"], f"{key}.reason"))


def _implementations(check: _Checker, raw, profile: str, params: dict) -> tuple:
    from fpemu.adapters import get_adapter
    out = []
    for key, adapter, device, body, reason in _implementation_tables(check, raw, "scaler"):
        adapter_profile = get_adapter(adapter).profile
        if "params" in body:
            impl_params = _profile_params(check, adapter_profile, body["params"], f"{key}.params")
        elif adapter_profile == profile:
            impl_params = dict(params)
        else:
            check.fail(f"{key}.params", f"required: {adapter} runs under another profile than {profile}")
        out.append(Implementation(adapter, impl_params, device, reason))
    return tuple(out)


def _record_fields(check: _Checker, raw: dict, kind: str) -> tuple:
    available = fields_recorded_by(kind)
    record = check.table(raw.get("record", {}), "record", {"fields"})
    fields = record.get("fields", list(fields_recorded_by(kind, by_default=True)))
    if not isinstance(fields, list) or not fields:
        check.fail("record.fields", "expected a non-empty list of field names")
    for index, field in enumerate(fields):
        check.choice(field, f"record.fields[{index}]", available)
    return tuple(fields)


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _scenario(check: _Checker, kind, raw: dict, text: str, path: str, **fields):
    name = check.string(raw.get("name", pathlib.Path(path).stem), "name")
    if not _NAME.fullmatch(name) or ".." in name:
        check.fail("name", f"expected letters, digits, '_', '.' and '-' (it names the trace files), got {name!r}")
    return kind(name=name,
                    description=check.string(raw.get("description", ""), "description"),
                    path=str(path), sha256=hashlib.sha256(text.encode()).hexdigest(), text=text, **fields)


def _step_source(check: _Checker, raw) -> StepSource:
    keys = {f.name for f in dataclasses.fields(StepSource)}
    check.table(raw, "step", keys)
    fields = {}
    if "mode" in raw:
        fields["mode"] = check.choice(raw["mode"], "step.mode", STEP_MODES)
    if "compute" in raw:
        mode = fields.get("mode", StepSource.mode)
        fields["compute"] = check.choice(raw["compute"], "step.compute", checked_compute(get_semantics(mode)))
    for key in ("batch", "features", "outputs"):
        if key in raw:
            fields[key] = check.integer(raw[key], f"step.{key}", 1)
    for key, low, high in (("magnitude", 1e-30, 1e30), ("spread", 0.0, 100.0), ("lr", 1e-12, 1e30),
                           ("init_scale", 1e-30, 3.2e38)):
        if key in raw:
            fields[key] = check.number(raw[key], f"step.{key}", low, high)
    for key in ("seed", "growth_interval"):
        if key in raw:
            fields[key] = check.integer(raw[key], f"step.{key}", 0 if key == "seed" else 1)
    return StepSource(**fields)


def _step_implementations(check: _Checker, raw) -> tuple:
    from fpemu.adapters import get_adapter
    out = []
    for key, adapter, device, body, reason in _implementation_tables(check, raw, "step"):
        accepted = get_adapter(adapter).params
        params = check.table(body.get("params", {}), f"{key}.params", accepted)
        for param, value in params.items():
            check.choice(value, f"{key}.params.{param}", accepted[param])
        out.append(Implementation(adapter, dict(params), device, reason))
    return tuple(out)


def _check_observable(check: _Checker, fields: tuple, implementations: tuple) -> None:
    """Every declared implementation records at least one of the fields the spec records (the
    DeepSpeed engine rows, say, have no growth counter)."""
    from fpemu.adapters import get_adapter
    for impl in implementations:
        observable = get_adapter(impl.name).fields
        if not set(fields) & set(observable):
            check.fail(f"implementations.{impl.name}", f"records none of record.fields ({', '.join(fields)}); "
                                                      f"it records {', '.join(observable)}")


def _parse_step_spec(check: _Checker, raw: dict, text: str, path: str) -> StepScenario:
    for key in ("scaler", "overflow"):
        if key in raw:
            check.attempt(check.fail, key, "a [step] scenario has its own scale rule and data; remove this table")
    steps = check.attempt(check.integer, raw["steps"], "steps", 1) if "steps" in raw else None
    step = check.attempt(_step_source, check, raw["step"])
    implementations = check.attempt(_step_implementations, check, raw.get("implementations", {}))
    record = check.attempt(_record_fields, check, raw, "step")
    check.raise_errors()
    return _scenario(check, StepScenario, raw, text, path, steps=steps, step=step,
                     implementations=implementations, record=record)


def _scaler(check: _Checker, raw) -> tuple:
    scaler = check.table(raw, "scaler", {"profile", "params"})
    profile = check.choice(scaler.get("profile"), "scaler.profile", tuple(PROFILES))
    return profile, _profile_params(check, profile, scaler.get("params", {}), "scaler.params")


def _check_overflow_fits(check: _Checker, overflow: OverflowSource, steps, profile, params) -> None:
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


def parse_spec(text: str, path: str = "<string>") -> ScalerScenario | StepScenario | RecipeScenario:
    """Validate TOML ``text`` and build its scenario: a :class:`StepScenario` for a spec with
    a [step] table, a :class:`~fpemu.specs.recipes.RecipeScenario` for one with a [recipe] table,
    else a :class:`ScalerScenario`."""
    check = _Checker(path)
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {len(text):,} characters, over the {MAX_SPEC_BYTES:,} a spec may hold "
                        "(fpemu.specs.bounds)")
    try:
        raw = tomllib.loads(text)
    except ValueError as error:  # TOMLDecodeError, and an integer literal past Python's 4,300 digits
        raise SpecError(f"{path}: not valid TOML: {error}") from None
    except RecursionError:
        raise SpecError(f"{path}: not valid TOML: arrays or tables nested too deep to read") from None
    check.table(raw, "", _TOP_KEYS)
    for key, parser in SCENARIO_KINDS.items():
        if key in raw:
            check.kind = key
            module, _, function = parser.partition(":")
            return getattr(importlib.import_module(module), function)(check, raw, text, path)
    if "step" in raw:
        if not isinstance(raw["step"], dict):
            check.fail("step", f"expected a [step] table (the step scenario's settings), got {raw['step']!r}; "
                               "the number of steps is `steps`")
        if "steps" not in raw:
            check.fail("steps", "missing required key")
        check.kind = "step"
        return _parse_step_spec(check, raw, text, path)
    for required in ("steps", "scaler", "overflow"):
        if required not in raw:
            check.attempt(check.fail, required, "missing required key")
    check.kind = "model" if isinstance(raw.get("overflow"), dict) and raw["overflow"].get("source") == "model" else "scaler"
    steps = check.attempt(check.integer, raw["steps"], "steps", 1) if "steps" in raw else None
    profile, params = (check.attempt(_scaler, check, raw["scaler"]) if "scaler" in raw else None) or (None, None)
    overflow = check.attempt(_overflow_source, check, raw["overflow"]) if "overflow" in raw else None
    fields = implementations = None  # (left None only where an error is recorded)
    if overflow is not None:
        check.attempt(_check_overflow_fits, check, overflow, steps, profile, params)
        fields = check.attempt(_record_fields, check, raw, "model" if overflow.kind == "model" else "scaler")
        if fields is not None and not set(fields) & set(OBSERVED_FIELDS):
            check.attempt(check.fail, "record.fields", f"record at least one of {', '.join(OBSERVED_FIELDS)}: "
                                                       "the real implementations are compared on those")
    if profile is not None:
        implementations = check.attempt(_implementations, check, raw.get("implementations", {}), profile, params)
    if fields is not None and implementations is not None:
        check.attempt(_check_observable, check, fields, implementations)
    check.raise_errors()
    return _scenario(check, ScalerScenario, raw, text, path, steps=steps, profile=profile, params=params,
                     overflow=overflow, implementations=implementations, record=fields)


def load_spec(path) -> ScalerScenario | StepScenario:
    """Load and validate one spec file."""
    data = read_bounded(path, SpecError, MAX_SPEC_BYTES)
    try:
        return parse_spec(data.decode("utf-8"), str(path))
    except UnicodeDecodeError as problem:
        raise SpecError(f"{path}: cannot read: not UTF-8 ({problem.reason} at byte {problem.start})") from None


def find_specs(paths) -> list:
    """Spec files named by ``paths``: files as given, folders searched for ``*.toml`` (sorted)."""
    found = []
    for path in map(pathlib.Path, paths):
        if path.is_dir():
            found.extend(sorted(path.rglob("*.toml")))
        elif path.is_file():
            found.append(path)
        else:
            raise SpecError(f"{path}: no such spec file or folder")
    if not found:
        raise SpecError(f"no *.toml specs under {', '.join(map(str, paths))}")
    return found


def load_specs(paths) -> list:
    """Every spec under ``paths``; two specs with one name (their traces would collide) are an error."""
    scenarios, seen = [], {}
    for path in find_specs(paths):
        scenario = load_spec(path)
        if scenario.name in seen:
            raise SpecError(f"{path}: name {scenario.name!r} is also the name of {seen[scenario.name]}; "
                            "spec names must be unique (set `name = ...` in one of them)")
        seen[scenario.name] = path
        scenarios.append(scenario)
    return scenarios
