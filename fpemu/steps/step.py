"""Seed 002: one mixed-precision step of a linear model with a dynamic loss scale."""

from __future__ import annotations

import numbers

import numpy as np

from fpemu.formats import FORMATS, Format, get_format
from fpemu.steps.kernel import F32, Kernel
from fpemu.steps.model import forward_backward, sgd_update, unscale
from fpemu.steps.semantics import DEFAULT_SEMANTICS, FITTED_COMPUTE, FITTED_MAX_DIM, StepSemantics, get_semantics

COMPUTE_FORMATS = ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2", "fp32")


def compute_format(compute) -> Format:
    """The compute format ``compute`` names or equals (aliases such as ``"bfloat16"`` accepted), as
    its named :data:`FORMATS` entry: the step's rounding rules go by that name."""
    if not isinstance(compute, (str, Format)):
        raise TypeError(f"compute must be a format name, got {type(compute).__name__}")
    try:
        fmt = get_format(compute)
    except ValueError:
        raise ValueError(f"compute: unknown format {compute!r}; compute formats: "
                         f"{', '.join(COMPUTE_FORMATS)}") from None
    named = next((FORMATS[name] for name in COMPUTE_FORMATS if FORMATS[name] == fmt), None)
    if named is None:
        raise ValueError(f"compute: {fmt.name!r} is not a compute format; use one of {', '.join(COMPUTE_FORMATS)}")
    return named


def float32_array(value, name: str, ndim: int) -> np.ndarray:
    """value as a float32 array of ``ndim`` dimensions, none of them empty."""
    try:
        arr = np.asarray(value, dtype=np.float64 if not isinstance(value, np.ndarray) else None)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an array of numbers, got {type(value).__name__}") from None
    if arr.dtype.kind not in "fiu" or arr.dtype == bool:
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != ndim or 0 in arr.shape:
        raise ValueError(f"{name} must be a non-empty {ndim}-d array, got shape {arr.shape}")
    with np.errstate(over="ignore"):
        return arr.astype(F32, copy=False)  # one rounding to float32 (as jnp.asarray(..., float32))


def positive_float32(value, name: str) -> np.float32:
    """value as a float32 scalar that is positive and finite."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.ndarray)) or np.ndim(value) != 0:
        raise TypeError(f"{name} must be a number, got {value!r}")
    with np.errstate(over="ignore"):
        result = F32(value)
    if not np.isfinite(result) or result <= 0:
        raise ValueError(f"{name} must be a positive finite float32 value, got {value!r}")
    return result


def check_int(value, name: str, low: int, high=None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def checked_compute(semantics: StepSemantics) -> tuple:
    """The compute formats ``semantics`` may run: those every fitted order in it was checked for
    against its framework (all of them where no order is fitted)."""
    fitted = [order for order in (semantics.dot, semantics.reduce) if order in FITTED_COMPUTE]
    return tuple(name for name in COMPUTE_FORMATS if all(name in FITTED_COMPUTE[order] for order in fitted))


def check_fitted_compute(semantics: StepSemantics, fmt: Format) -> None:
    """Fitted orders are claimed only where they were checked against the framework."""
    checked = checked_compute(semantics)
    if fmt.name not in checked:
        raise ValueError(f"mode {semantics.name!r}: fitted and checked for compute {', '.join(checked)} only, "
                         f"got {fmt.name!r}; use mode='numpy' or 'seed'")


def check_fitted_shape(semantics: StepSemantics, **dims) -> None:
    if semantics.reduce == "inductor_cpu" and not semantics.inductor_decompositions and min(dims.values()) < 2:
        shape = ", ".join(f"{key}={value}" for key, value in dims.items())
        raise ValueError(f"mode {semantics.name!r}: modelled for dimensions 2..{FITTED_MAX_DIM} only (a dimension "
                         f"of 1 makes inductor decompose the matmuls into other code), got {shape}")
    if semantics.fitted and max(dims.values()) > FITTED_MAX_DIM:
        shape = ", ".join(f"{key}={value}" for key, value in dims.items())
        raise ValueError(f"mode {semantics.name!r}: its orders were fitted for dimensions 1..{FITTED_MAX_DIM}, "
                         f"got {shape}; use mode='numpy' or 'seed' for larger shapes")


def _linear_inputs(params, x, y):
    if not isinstance(params, dict) or set(params) != {"w", "b"}:
        raise TypeError(f"params must be a dict with keys 'w' and 'b', got {params!r:.80}")
    w = float32_array(params["w"], "params['w']", 2)
    b = float32_array(params["b"], "params['b']", 1)
    x = float32_array(x, "x", 2)
    y = float32_array(y, "y", 2)
    (batch, dim), (w_in, out) = x.shape, w.shape
    if w_in != dim:
        raise ValueError(f"params['w'] must have shape (D, K) with D = x.shape[1] = {dim}, got {w.shape}")
    if b.shape != (out,):
        raise ValueError(f"params['b'] must have shape (K,) = ({out},), got {b.shape}")
    if y.shape != (batch, out):
        raise ValueError(f"y must have shape (B, K) = ({batch}, {out}), got {y.shape}")
    return w, b, x, y


def mixed_precision_step(params, x, y, loss_scale, good_steps, lr, growth_interval, *,
                         compute: str = "bf16", mode=DEFAULT_SEMANTICS) -> dict:
    """One step of seed 002: low-precision linear model, float32 master weights, dynamic loss scale.

    The prediction ``x_c @ w_c + b_c`` is computed in the compute format, the loss is the
    float32 mean squared error, ``S * loss`` is differentiated back through every cast, the
    gradients are divided by S, and the update and the scale follow the seed's rules
    (double after ``growth_interval`` finite steps; halve, not below 1.0, on a non-finite
    gradient, keeping the params).  ``docs/steps.md`` says where each rounding happens.

    Args:
      params: ``{"w": (D, K), "b": (K,)}`` float32 master weights.
      x, y: float32 input (B, D) and target (B, K).
      loss_scale: the scale S, a positive finite float32.
      good_steps: consecutive finite steps so far, 0 to growth_interval - 1.
      lr: the learning rate, positive.
      growth_interval: finite steps after which the scale doubles, at least 1.
      compute: ``"bf16"``, ``"fp16"``, ``"fp8_e4m3fn"``, ``"fp8_e5m2"`` or ``"fp32"``.
      mode: a preset of :data:`fpemu.steps.SEMANTICS` or a :class:`StepSemantics`:
        ``"jax_cpu_strict"`` (default: jax.jit on the CPU with
        ``--xla_allow_excess_precision=false``, which gives the seed's outputs), ``"jax_cpu"``
        (default XLA flags), ``"torch_cpu"``, ``"seed"`` (the text read literally) or ``"numpy"``.

    Returns:
      ``{"loss", "params": {"w", "b"}, "loss_scale", "good_steps", "grads_finite"}`` as numpy
      float32 / int32 / bool values.

    Example:
      >>> out = mixed_precision_step({"w": [[0.5], [-1.25]], "b": [0.1]}, [[1.0, 2.0], [0.5, -1.0]],
      ...                            [[-1.9], [1.5]], 1024.0, 0, 0.1, 2)
      >>> round(float(out["loss"]), 6), round(float(out["params"]["b"][0]), 6), int(out["good_steps"])
      (0.005159, 0.089697, 1)
    """
    semantics = get_semantics(mode)
    fmt = compute_format(compute)
    w, b, x, y = _linear_inputs(params, x, y)
    growth_interval = check_int(growth_interval, "growth_interval", 1)
    good_steps = check_int(good_steps, "good_steps", 0, growth_interval - 1)
    scale = positive_float32(loss_scale, "loss_scale")
    lr = positive_float32(lr, "lr")
    check_fitted_compute(semantics, fmt)
    check_fitted_shape(semantics, B=x.shape[0], D=x.shape[1], K=w.shape[1])
    k = Kernel(semantics, fmt)

    loss, [(gw, gb)] = forward_backward(k, [(w, b)], x, y, scale)
    gw, gb = unscale(k, gw, scale), unscale(k, gb, scale)
    finite = bool(np.all(np.isfinite(gw)) and np.all(np.isfinite(gb)))
    if finite:
        w, b = sgd_update(k, w, gw, lr), sgd_update(k, b, gb, lr)
        counted = good_steps + 1
        grow = counted >= growth_interval
        new_scale = k.mul(scale, F32(2)) if grow else scale  # may overflow to inf, as in float32
        new_good = 0 if grow else counted
    else:  # params pass through bit for bit (a select, not arithmetic)
        new_scale = max(k.mul(scale, F32(0.5)), F32(1.0))
        new_good = 0
    return {"loss": F32(loss), "params": {"w": np.asarray(w, F32), "b": np.asarray(b, F32)},
            "loss_scale": F32(new_scale), "good_steps": np.int32(new_good), "grads_finite": np.bool_(finite)}
