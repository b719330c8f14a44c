"""Short readings of a first divergence: a dict-valued field summarized (which keys, how far), and the
likely cause of a difference between two recordings of a user's loop read from the gradients they recorded.

A recorded run's ``grad_stats`` hold a dozen numbers per gradient group; printing both dicts made a
first-divergence line of thousands of characters.  :func:`summarize_dicts` names the groups and the
statistics that differ and the largest change.  :func:`recorded_cause` reads two recordings of one loop:
where the loss agrees and the gradients do not, the loop changed its gradients between backward and the
optimizer; a factor shared by every group is a global rescale, which is what clipping the still-scaled
gradients (``clip_grad_norm_`` before ``scaler.unscale_``) does.
"""

from __future__ import annotations

import math
from typing import Optional

from fpemu.traces import Trace, decode_value
from fpemu.traces.recorded import is_recorded

SHOWN_KEYS = 3  # keys named in a summary; the rest are counted
GRADIENT_FIELDS = ("grad_stats", "shadow", "shadow_histogram")
SHARED_FACTOR = 1e-3  # relative spread under which every group's factor counts as one factor


def _leaves(value, prefix: str = "") -> dict:
    """A nested dict flattened to ``a.b`` -> value, each float read from its ``_hex`` twin (bit-exact)."""
    out = {}
    for key, item in value.items():
        if key.endswith("_hex"):
            continue
        if isinstance(item, dict):
            out.update(_leaves(item, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = decode_value(value, key)
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
    return a == b and type(a) is type(b)


def _names(keys) -> str:
    keys = list(keys)
    shown = ", ".join(map(str, keys[:SHOWN_KEYS]))
    return shown + (f", ... ({len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else "")


def _short(value) -> str:
    """A value as a summary shows it (the trace and --json keep every bit)."""
    return repr(float(f"{value:.6g}")) if isinstance(value, float) and math.isfinite(value) else repr(value)


def _factor(before, after) -> Optional[float]:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (before, after))
    return after / before if numbers and before else None


def summarize_dicts(expected: dict, got: dict) -> str:
    """Which top-level keys of two dict values differ, in which entries, and the largest change.

    Example:
      >>> a = {"fc": {"max_abs": 8.0, "zero": 0.0}, "out": {"max_abs": 2.0, "zero": 0.0}}
      >>> b = {"fc": {"max_abs": 1.0, "zero": 0.0}, "out": {"max_abs": 2.0, "zero": 0.5}}
      >>> summarize_dicts(a, b)
      '2 of 2 keys differ (fc, out) in max_abs, zero; largest: fc.max_abs 8.0 -> 1.0 (x0.125)'
      >>> summarize_dicts({"a": {"n": 1}}, {"b": {"n": 1}})
      'keys only before: a; only after: b'
    """
    only_before, only_after = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if only_before or only_after:
        return f"keys only before: {_names(only_before) or 'none'}; only after: {_names(only_after) or 'none'}"
    flat_a, flat_b = _leaves(expected), _leaves(got)
    differ = [key for key in flat_a if key in flat_b and not _same(flat_a[key], flat_b[key])]
    differ += [key for key in flat_b if key not in flat_a]
    tops = list(dict.fromkeys(key.split(".", 1)[0] for key in differ))
    inner = list(dict.fromkeys(key.split(".", 1)[-1] for key in differ))
    text = f"{len(tops)} of {len(expected)} keys differ ({_names(tops)})"
    text += f" in {_names(inner)}" if inner != tops else ""

    def distance(key):  # a change with a factor first (a share going 0 -> 0.5 has none)
        factor = _factor(flat_a.get(key), flat_b.get(key))
        return (factor is not None, abs(math.log(abs(factor))) if factor else 0.0)
    largest = max(differ, key=distance, default=None)
    if largest is not None:
        factor = _factor(flat_a.get(largest), flat_b.get(largest))
        text += (f"; largest: {largest} {_short(flat_a.get(largest))} -> {_short(flat_b.get(largest))}"
                 + (f" (x{factor:.3g})" if factor else ""))
    return text


def _group_factors(before: dict, after: dict) -> dict:
    """group -> after/before of the largest gradient magnitude, where both are finite and nonzero."""
    out = {}
    for group in set(before) & set(after):
        factor = _factor(decode_value(before[group], "max_abs"), decode_value(after[group], "max_abs"))
        if factor:
            out[group] = factor
    return out


def _rescale_reading(step: int, a: Trace, b: Trace) -> str:
    """The gradient factor every group shares, and the norm the scaled gradients then have."""
    factors = _group_factors(decode_value(a.steps[step], "grad_stats"), decode_value(b.steps[step], "grad_stats"))
    if not factors:
        return ""
    low, high = min(factors.values()), max(factors.values())
    if (high - low) > SHARED_FACTOR * abs(high) or len(factors) < 2:
        changed = [group for group, factor in sorted(factors.items()) if abs(factor - 1) > SHARED_FACTOR]
        return f"; groups change by different factors ({_names(changed)}): a hook or per-group clipping"
    factor = (low + high) / 2
    scale, norm = decode_value(a.steps[step], "scale"), decode_value(a.steps[step], "grad_norm")
    # the smaller gradients' scaled norm: 1 where clip_grad_norm_(max_norm=1) clipped them still scaled
    scaled = min(factor, 1 / factor) * scale * norm if isinstance(scale, float) and isinstance(norm, float) else math.nan
    scaled = f" (scaled norm {scaled:.3g})" if math.isfinite(scaled) else ""
    return (f"; every group's are x{factor:.3g}{scaled}: clipping the still-scaled gradients "
            "(clip_grad_norm_ before scaler.unscale_; the recorder's rec.audit.findings names it)")


def recorded_cause(field: str, step: int, a: Trace, b: Trace) -> Optional[str]:
    """The likely cause of a first divergence at ``step``, ``field`` between two recorded runs, followed by
    what one run's audit found that the other's did not (None where either trace is no recording, or neither
    the field nor the audits say anything)."""
    if not (is_recorded(a) and is_recorded(b)) or step >= min(len(a.steps), len(b.steps)):
        return None
    return "; ".join(filter(None, [_step_reading(field, step, a, b), _audit_difference(a, b)])) or None


def _step_reading(field: str, step: int, a: Trace, b: Trace) -> Optional[str]:
    loss_agrees = _same(decode_value(a.steps[step], "loss"), decode_value(b.steps[step], "loss"))
    if field in GRADIENT_FIELDS + ("grad_norm",) and loss_agrees:
        rescale = _rescale_reading(step, a, b) if field == "grad_stats" else ""
        return ("the loss agrees, the gradients do not: the loop changes them between backward and the "
                f"optimizer (clipping, a hook){rescale}")
    if field == "loss" and step == 0:
        return "the first loss differs: the model, its initialization, the data or the forward pass differ"
    if field == "loss" or (field in GRADIENT_FIELDS + ("grad_norm",) and step > 0):
        what = "the loss differs" if field == "loss" else "the loss and the gradients differ"
        return (f"{what} from step {step} on: the update at step {step - 1} differed (its gradients, "
                "their clipping or unscaling, the optimizer or its learning rate)")
    return None


def _audit_difference(a: Trace, b: Trace) -> str:
    """What one recording's audit found that the other's did not (``metadata.audit_findings``), or ""."""
    found_a, found_b = a.metadata.get("audit_findings") or {}, b.metadata.get("audit_findings") or {}
    parts = []
    for kind in sorted(set(found_a) | set(found_b)):
        if found_a.get(kind) != found_b.get(kind):
            where = [f"{label} {found[kind]['count']}x from step {found[kind]['first_step']}"
                     for label, found in (("first run", found_a), ("second run", found_b)) if kind in found]
            parts.append(f"{kind} ({', '.join(where) or 'in neither'})")
    return ("the recorded audits differ: " + "; ".join(parts) + " (rec.audit.findings)") if parts else ""


def initial_scale_cause(field: str, step: int, a: Trace, b: Trace) -> Optional[str]:
    """A loss scaler's scales differ at the first step: nothing ran yet, so the initial scales differ (None
    otherwise; an fp8 recipe's first scale comes from its amax, not from an initial scale)."""
    loss_scaler = a.steps and b.steps and "overflow" in a.steps[0] and "amax" not in a.steps[0]
    if field != "scale" or step != 0 or not loss_scaler:
        return None
    before, after = decode_value(a.steps[0], "scale"), decode_value(b.steps[0], "scale")
    return (f"the initial scale differs ({_short(before)} -> {_short(after)}): the scalers start at another "
            "init_scale (or another profile's default)")
