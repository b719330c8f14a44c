"""Per-tensor fp8 scaling recipes: reference models of Transformer Engine and torchao, step for step.

fp8 training replaces the loss scale with one scale per tensor: the cast computes
``fp8(x * scale)`` and the GEMM multiplies by ``scale_inv``.  The implementations
differ in where the amax comes from and in float32 details, and those differences
are what this module models, each recipe as one class with a frozen state (jmp
style) and pure functions:

* :class:`DelayedScaling` -- Transformer Engine's ``DelayedScaling``: the scale of
  step t+1 comes from an amax history; its ``fused`` (default, ``kernel_bulk``) and
  ``unfused`` (``NVTE_UNFUSED_FP8_UPDATE=1``) paths differ (see the class).
* :class:`CurrentScaling` -- ``Float8CurrentScaling``: each tensor's own amax, TE's
  CUDA kernel (``compute_scale_from_amax``) or its Python reference quantizer
  (``custom_recipes/reference_current_scaling.py``), which differ on inf and NaN.
* :class:`TorchaoScaling` -- torchao.float8's dynamic scaling, tensorwise or rowwise
  (axiswise), with or without ``round_scales_to_power_of_2``.

Each recipe's :data:`RECIPES` row pins the source it was read from.  Every
arithmetic step is float32 (numpy scalars), in the source's order of operations.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from fpemu.blocks.log2 import floor_log2
from fpemu.formats import encode, get_format, quantize

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
TORCHAO_EPS = 1e-12  # torchao.float8.float8_utils.EPS


@dataclasses.dataclass(frozen=True)
class RecipeSource:
    """Where a recipe model was read from, and how it was checked.

    Attributes:
      package: the project.
      version: the release or commit read.
      files: the files the arithmetic comes from.
      verified: ``driven`` (differential tests run the real code against the model) or
        ``source-derived`` (read and worked through; the real code needs a GPU).
    """

    package: str
    version: str
    files: str
    verified: str


# TE's two fp8 element formats and their maxima (delayed_scaling.cu fp8_dtype_max); HYBRID is e4m3
# forward, e5m2 backward.
FP8_FORMATS = ("fp8_e4m3fn", "fp8_e5m2")
AMAX_ALGOS = ("max", "most_recent")
PATHS = ("fused", "unfused")


def _f32(value) -> np.float32:
    return F32(value)


def _check_choice(value, name: str, options) -> None:
    if value not in options:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, options))}, got {value!r}")


def _check_flag(value, name: str) -> None:
    # a truthy string ("false") would turn the option on
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: expected true or false, got {value!r}")


def _check_number(value, name: str, low: float, high: float) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not low <= value <= high:
        raise ValueError(f"{name}: expected a number in [{low}, {high}], got {value!r}")


# 2^margin and 2^-margin stay finite, nonzero float32 factors; past them TE's scale is 0 or inf for every amax
MAX_MARGIN = 127


def fp8_max(fmt: str) -> np.float32:
    """The largest finite value of an fp8 format, as the recipes use it (448 for e4m3fn)."""
    return _f32(get_format(fmt).max_finite)


# --- casts ----------------------------------------------------------------------

def _scaled(x, scale) -> np.ndarray:
    """fl32(x * scale): every recipe rounds the product to float32 before the fp8 cast."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float32) * np.asarray(scale, dtype=np.float32)


# How each implementation's fp8 cast treats overflow: CUDA's cvt.rn.satfinite (TE's kernels; it
# saturates e5m2 too, inf included), torchao's clamp to +-max before the cast (NaN passes through),
# and torch 2.13's eager CPU cast, which saturates e4m3fn but overflows e5m2 to inf.
CASTS = {
    "satfinite": {"fp8_e4m3fn": "saturate", "fp8_e5m2": "saturate"},
    "clamp": {"fp8_e4m3fn": "saturate", "fp8_e5m2": "saturate"},
    "torch_eager": {"fp8_e4m3fn": "saturate", "fp8_e5m2": "inf"},
}


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A tensor cast to fp8 by a recipe.

    Attributes:
      amax: the amax the scale came from (a scalar, or one per row for rowwise scaling).
      scale: the float32 scale multiplied in (same shape as amax).
      scale_inv: what the GEMM multiplies by (float32).
      codes: the fp8 bit patterns (uint8).
      values: the fp8 values (float32).
    """

    amax: np.ndarray
    scale: np.ndarray
    scale_inv: np.ndarray
    codes: np.ndarray
    values: np.ndarray


def cast_to_fp8(x, scale, fmt: str, cast: str = "satfinite") -> tuple:
    """(codes, values) of fp8(fl32(x * scale)) under one of :data:`CASTS`.

    Args:
      x: float32 values (bf16/fp16 arrays widen exactly).
      scale: the float32 scale (a scalar, or one per row broadcasting against x).
      fmt: ``fp8_e4m3fn`` or ``fp8_e5m2``.
      cast: ``satfinite`` (TE's kernels), ``clamp`` (torchao) or ``torch_eager`` (torch 2.13's CPU cast).

    Returns:
      (uint8 codes, float32 values), x's shape.

    Example:
      >>> codes, values = cast_to_fp8([1.0, 500.0, float("inf")], 1.0, "fp8_e4m3fn")
      >>> [hex(int(c)) for c in codes], values.tolist()
      (['0x38', '0x7e', '0x7e'], [1.0, 448.0, 448.0])
    """
    _check_choice(cast, "cast", CASTS)
    _check_choice(fmt, "fmt", FP8_FORMATS)
    values = quantize(_scaled(x, scale), fmt, overflow=CASTS[cast][fmt])
    return encode(values, fmt), values


def _reciprocal(scale) -> np.ndarray:
    """__frcp_rn / torch.reciprocal: 1/scale rounded once to float32."""
    with np.errstate(divide="ignore", over="ignore"):  # 1/0 and 1/subnormal are inf, as on the GPU
        return F32(1.0) / np.asarray(scale, dtype=np.float32)


# --- amax -----------------------------------------------------------------------

def te_amax(x) -> np.float32:
    """TE's amax kernel: fmaxf(fabsf(x)) from 0, which ignores NaN (all-NaN gives 0).

    Example:
      >>> float(te_amax([1.0, float("nan"), -3.0]))
      3.0
    """
    values = np.abs(np.asarray(x, dtype=np.float32)).ravel()
    return F32(np.fmax.reduce(values, initial=F32(0.0)))


def torch_amax(x, axis: Optional[int] = None) -> np.ndarray:
    """torch.max / torch.amax of |x| (float32): NaN propagates; ``axis`` keeps its dim (rowwise).

    Example:
      >>> torch_amax([[1.0, -2.0], [float("nan"), 0.5]], axis=-1).ravel().tolist()
      [2.0, nan]
    """
    values = np.abs(np.asarray(x, dtype=np.float32))
    if axis is None:
        return F32(np.max(values))
    return np.max(values, axis=axis, keepdims=True)


# --- Transformer Engine: delayed scaling -----------------------------------------

@dataclasses.dataclass(frozen=True)
class DelayedScalingState:
    """TE's per-tensor fp8 meta: the amax history (slot 0 holds the current step's amax) and the scale.

    Attributes:
      amax_history: float32 values as Python floats, newest last after a roll; slot 0 is where the
        next step's amax is written.
      scale: the scale the next step casts with.
      amax: the amax the last update computed the scale from (0 before any update).
    """

    amax_history: tuple
    scale: float
    amax: float = 0.0


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine ``DelayedScaling`` for one tensor: the scale of the next step from the amax history.

    After each step, TE writes the step's amax into ``amax_history[0]`` and updates:

    * ``fused`` (the default; ``kernel_bulk`` in delayed_scaling.cu): ``last = history[0]``; if
      ``last != 0`` the history rolls (``new[i] = old[i+1]``, ``new[-1] = last``, ``new[0] = 0``) and
      the amax is the ``fmaxf`` of that window, which ignores NaN; if ``last == 0`` nothing rolls and
      the amax is 0.  ``most_recent`` takes ``last``.  ``scale = (fp8_max * 2^-margin) / amax``.
    * ``unfused`` (``NVTE_UNFUSED_FP8_UPDATE=1``, or a callable algo): ``amax = torch.max(history)``,
      which propagates NaN, then the roll and ``[0] = 0`` always; ``scale = (fp8_max / amax) / 2^margin``,
      where ``fp8_max / amax`` is torch's ``Tensor.__rtruediv__``: ``fl32(fl32(1/amax) * fp8_max)``, which
      differs from the fused kernel's one division in the last bit for some amaxes (117: 3.8290601
      unfused, 3.8290598 fused).

    Both keep the old scale when the amax is 0, inf or NaN, and turn an inf scale into FLT_MAX.
    The paths differ after zero-amax steps (the fused path does not roll), after a NaN (the unfused
    path freezes the scale for ``amax_history_len`` steps) and for tiny amaxes with a margin (the
    unfused quotient overflows before the division by 2^margin).

    Attributes:
      fp8_format: ``fp8_e4m3fn`` (448) or ``fp8_e5m2`` (57344).
      margin: the scale is lowered by 2^margin.
      amax_history_len: the history length (TE's default 1024).
      amax_compute_algo: ``max`` or ``most_recent``.
      path: ``fused`` or ``unfused``.

    Example:
      >>> recipe = DelayedScaling(amax_history_len=2)
      >>> [float(s) for s in recipe.run([4.0, 0.0, 0.0, 1.0, 1.0]).scale]
      [112.0, 112.0, 112.0, 112.0, 448.0]
      >>> unfused = DelayedScaling(amax_history_len=2, path="unfused")
      >>> [float(s) for s in unfused.run([4.0, 0.0, 0.0, 1.0, 1.0]).scale]
      [112.0, 112.0, 112.0, 448.0, 448.0]
    """

    fp8_format: str = "fp8_e4m3fn"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    path: str = "fused"

    def __post_init__(self):
        _check_choice(self.fp8_format, "fp8_format", FP8_FORMATS)
        _check_choice(self.amax_compute_algo, "amax_compute_algo", AMAX_ALGOS)
        _check_choice(self.path, "path", PATHS)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or abs(self.margin) > MAX_MARGIN:
            raise ValueError(f"margin: expected an integer in -{MAX_MARGIN}..{MAX_MARGIN} (2^margin a finite float32 "
                             f"factor), got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len: expected an integer >= 1, got {self.amax_history_len!r}")

    def init(self, scale: float = 1.0) -> DelayedScalingState:
        """TE's initial meta: a zero history and scale 1."""
        return DelayedScalingState((0.0,) * self.amax_history_len, float(_f32(scale)))

    def update(self, state: DelayedScalingState, amax: float) -> DelayedScalingState:
        """The state after a step whose tensor had amax ``amax`` (written into slot 0, then updated)."""
        history = np.array(state.amax_history, dtype=np.float32)
        history[0] = _f32(amax)
        update = _fused_update if self.path == "fused" else _unfused_update
        new_history, used, scale = update(self, history, _f32(state.scale))
        return DelayedScalingState(tuple(float(v) for v in new_history), float(scale), float(used))

    def quantize(self, state: DelayedScalingState, x) -> Fp8Tensor:
        """Cast ``x`` (float32) with the state's scale, as TE's cast kernel does: ``fp8(fl32(x * scale))``
        saturating, and the tensor's NaN-ignoring amax, which :meth:`update` takes after the step.

        Example:
          >>> recipe = DelayedScaling(amax_history_len=2)
          >>> state = recipe.update(recipe.init(), 4.0)          # the scale after a step of amax 4
          >>> fp8 = recipe.quantize(state, np.array([1.0, 8.0], np.float32))
          >>> fp8.values.tolist(), float(fp8.amax)              # 8 * 112 saturates
          ([112.0, 448.0], 8.0)
        """
        scale = _f32(state.scale)
        codes, values = cast_to_fp8(x, scale, self.fp8_format, "satfinite")
        return Fp8Tensor(np.asarray(te_amax(x)), np.asarray(scale), _reciprocal(scale), codes, values)

    def run(self, amaxes, scale: float = 1.0) -> "RecipeRun":
        """Every step's amax, the amax the update used and the scale after it (the next step's)."""
        state, used, scales = self.init(scale), [], []
        for amax in amaxes:
            state = self.update(state, amax)
            used.append(state.amax)
            scales.append(state.scale)
        return RecipeRun.of(amaxes, used, scales)


def _rolled(history: np.ndarray, last: np.float32) -> np.ndarray:
    """new[i] = old[i+1], new[-1] = last, new[0] = 0 (both paths' roll)."""
    rolled = np.concatenate([history[1:], [last]]).astype(np.float32)
    rolled[0] = 0.0
    return rolled


def _keep_or_flt_max(scale, old_scale, amax) -> np.float32:
    """Both paths: the old scale when the amax is not finite and > 0; an inf scale becomes FLT_MAX."""
    if not (np.isfinite(amax) and amax > 0):
        scale = old_scale
    return FLT_MAX if np.isinf(scale) else F32(scale)


def _fused_update(recipe: DelayedScaling, history: np.ndarray, old_scale: np.float32) -> tuple:
    last = history[0]  # one rank: the reduction buffer holds history[0]
    window = np.concatenate([history[1:], [last]]).astype(np.float32)
    rolls = last != 0
    amax = F32(np.fmax.reduce(window, initial=F32(0.0))) if rolls else F32(0.0)
    if recipe.amax_compute_algo == "most_recent":
        amax = last
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # a margin of -127 overflows, as TE's does
        scaled_max = fp8_max(recipe.fp8_format) * F32(2.0 ** -recipe.margin)
        scale = scaled_max / amax
    return (_rolled(history, last) if rolls else history), amax, _keep_or_flt_max(scale, old_scale, amax)


def _unfused_update(recipe: DelayedScaling, history: np.ndarray, old_scale: np.float32) -> tuple:
    amax = F32(np.max(history)) if recipe.amax_compute_algo == "max" else history[0]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        # `fp8_max / amax` with a Python float over a tensor is Tensor.__rtruediv__, which torch
        # implements as amax.reciprocal() * fp8_max: two roundings, not one division.
        scale = ((F32(1.0) / amax) * fp8_max(recipe.fp8_format)) / F32(2.0 ** recipe.margin)
    return _rolled(history, history[0]), amax, _keep_or_flt_max(scale, old_scale, amax)


# --- Transformer Engine: current scaling -----------------------------------------

CURRENT_IMPLEMENTATIONS = ("kernel", "reference")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Transformer Engine ``Float8CurrentScaling``: each tensor cast with a scale from its own amax.

    * ``kernel`` (``compute_scale_from_amax``): the amax ignores NaN (fmaxf); ``amax < eps -> eps``;
      inf, 0 or NaN give scale 1; else ``__fdiv_rn(fp8_max, amax)``, inf -> FLT_MAX; power-of-two
      scales keep the bits ``& 0xFF800000``; ``scale_inv = __frcp_rn(scale)``; the cast saturates
      (``cvt.rn.satfinite``) in both formats.
    * ``reference`` (the Python reference quantizer): ``torch.amax`` propagates NaN; ``max(amax, eps)``;
      ``fp8_max / amax`` with inf -> the input dtype's max; power-of-two by ``frexp`` (and 0 where the
      amax is inf); amax 0 -> 1; the cast is torch's eager one (e5m2 overflows to inf).  An inf amax
      gives scale 0 and a NaN amax scale NaN where the kernel gives 1.

    Attributes:
      fp8_format: ``fp8_e4m3fn`` or ``fp8_e5m2``.
      power_2_scales: ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``.
      amax_epsilon: the floor of the amax (TE's default 0).
      implementation: ``kernel`` or ``reference``.
      input_max: the reference's inf replacement, the input dtype's max (float32's by default).

    Example:
      >>> [float(CurrentScaling().scale_from_amax(a)) for a in (2.0, 0.0, float("inf"))]
      [224.0, 1.0, 1.0]
      >>> [float(CurrentScaling(implementation="reference").scale_from_amax(a)) for a in (2.0, 0.0, float("inf"))]
      [224.0, 1.0, 0.0]
    """

    fp8_format: str = "fp8_e4m3fn"
    power_2_scales: bool = False
    amax_epsilon: float = 0.0
    implementation: str = "kernel"
    input_max: float = float(FLT_MAX)

    def __post_init__(self):
        _check_choice(self.fp8_format, "fp8_format", FP8_FORMATS)
        _check_choice(self.implementation, "implementation", CURRENT_IMPLEMENTATIONS)
        _check_flag(self.power_2_scales, "power_2_scales")
        _check_number(self.amax_epsilon, "amax_epsilon", 0.0, float(FLT_MAX))
        _check_number(self.input_max, "input_max", 0.0, float(FLT_MAX))

    def amax(self, x) -> np.float32:
        """The tensor's amax as this implementation computes it."""
        return te_amax(x) if self.implementation == "kernel" else torch_amax(x)

    def scale_from_amax(self, amax) -> np.float32:
        """The float32 scale of a tensor whose amax is ``amax``."""
        if self.implementation == "kernel":
            return _te_kernel_scale(_f32(amax), fp8_max(self.fp8_format), self.power_2_scales,
                                    _f32(self.amax_epsilon))
        return _te_reference_scale(_f32(amax), fp8_max(self.fp8_format), self.power_2_scales,
                                   _f32(self.amax_epsilon), _f32(self.input_max))

    def quantize(self, x) -> Fp8Tensor:
        """Cast ``x`` (float32) to fp8 with its own scale."""
        amax = self.amax(x)
        scale = self.scale_from_amax(amax)
        cast = "satfinite" if self.implementation == "kernel" else "torch_eager"
        codes, values = cast_to_fp8(x, scale, self.fp8_format, cast)
        return Fp8Tensor(np.asarray(amax), np.asarray(scale), _reciprocal(scale), codes, values)

    def run(self, amaxes) -> "RecipeRun":
        """The scale of each step's amax (current scaling has no state)."""
        scales = [float(self.scale_from_amax(a)) for a in amaxes]
        floor = _kernel_amax_floor if self.implementation == "kernel" else np.maximum  # NaN: kept / propagated
        used = [float(floor(_f32(a), _f32(self.amax_epsilon))) for a in amaxes]
        return RecipeRun.of(amaxes, used, scales)


def _kernel_amax_floor(amax: np.float32, eps: np.float32) -> np.float32:
    return eps if amax < eps else amax  # NaN < eps is False: NaN stays


def mask_to_power_of_2(scale) -> np.ndarray:
    """TE's kernel: keep sign and exponent bits (``bits & 0xFF800000``), an exact floor to 2^k."""
    bits = np.asarray(scale, dtype=np.float32).view(np.uint32) & np.uint32(0xFF800000)
    return bits.view(np.float32)


def _te_kernel_scale(amax, max_fp8, pow2: bool, eps) -> np.float32:
    amax = _kernel_amax_floor(amax, eps)
    if np.isinf(amax) or amax == 0 or np.isnan(amax):
        return F32(1.0)
    with np.errstate(over="ignore"):
        scale = max_fp8 / amax
    if np.isinf(scale):
        scale = FLT_MAX  # value_for_inf of nvte_compute_scale_from_amax
    return F32(mask_to_power_of_2(scale)) if pow2 else F32(scale)


def _te_reference_scale(amax, max_fp8, pow2: bool, eps, input_max) -> np.float32:
    amax = F32(np.maximum(amax, eps))  # torch.max(amax, eps), as np.maximum: NaN propagates
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = max_fp8 / amax
    if scale == np.inf:
        scale = input_max
    if pow2:
        mantissa, exponent = np.frexp(F32(scale))
        scale = F32(np.ldexp(F32(1.0), int(exponent) - 1))  # frexp(0/NaN) has exponent 0: 0.5
        if amax == np.inf:
            scale = F32(0.0)
    return F32(1.0) if amax == 0 else F32(scale)


# --- torchao.float8 --------------------------------------------------------------

GRANULARITIES = ("tensorwise", "rowwise")


def torchao_round_down_to_power_of_2(scale) -> np.ndarray:
    """torchao's ``_round_scale_down_to_power_of_2``: ``torch.exp2(torch.floor(torch.log2(s)))`` in float32.

    torch's float32 log2 rounds to the integer k for s a few ulp below 2^k, so the result is 2^k where
    the exact floor is 2^(k-1) (see :func:`power_of_2_departures`); the floor is
    :func:`fpemu.blocks.log2.floor_log2`, torch's own on every positive float32 (its 44 largest: 128,
    so exp2 gives inf).  torch's exp2 of an integer k is 2^k exactly (-149..127, on its AVX512, AVX2 and
    default tiers), so 2^k is built with ldexp here: numpy's float32 exp2(127) is 2^127 plus one ulp on
    its AVX512 tier.  0 gives 0, inf inf, negatives and NaN NaN.

    Example:
      >>> s = np.float32(9.536738e-07)  # a few ulp below 2^-20
      >>> float(torchao_round_down_to_power_of_2(s)), float(mask_to_power_of_2(s))
      (9.5367431640625e-07, 4.76837158203125e-07)
    """
    exponent = floor_log2(np.asarray(scale, dtype=np.float32))
    finite = np.isfinite(exponent)
    with np.errstate(over="ignore"):
        power = np.ldexp(np.float32(1), np.where(finite, exponent, 0).astype(np.int32))
    return np.where(finite, power, np.where(exponent == -np.inf, np.float32(0), exponent)).astype(np.float32)


def scales_near_powers_of_2(low: int = -40, high: int = 40, ulps: int = 3) -> np.ndarray:
    """float32 scales within ``ulps`` ulp of 2^k (both sides, 2^k itself included) for k in low..high:
    where power-of-two rounding can go wrong.

    Example:
      >>> [float(s) for s in scales_near_powers_of_2(0, 0, 1)]
      [0.9999999403953552, 1.0, 1.0000001192092896]
    """
    powers = np.ldexp(np.float32(1), np.arange(low, high + 1)).view(np.int32)
    return np.concatenate([(powers + d).view(np.float32) for d in range(-ulps, ulps + 1)])


def power_of_2_departures(scales) -> int:
    """How many of ``scales`` torchao's power-of-two rounding sends up (to 2^k where the exact floor,
    TE's mask, is 2^(k-1)); finite positive scales only.

    Example:
      >>> power_of_2_departures(scales_near_powers_of_2(-2, 2, 1))  # only 2^-2 - 1 ulp: near 2^0, log2 resolves
      1
      >>> power_of_2_departures(scales_near_powers_of_2())
      215
    """
    scales = np.asarray(scales, dtype=np.float32)
    finite = np.isfinite(scales) & (scales > 0)
    return int(np.count_nonzero(torchao_round_down_to_power_of_2(scales[finite]) != mask_to_power_of_2(scales[finite])))


@dataclasses.dataclass(frozen=True)
class TorchaoScaling:
    """torchao.float8 dynamic scaling (``hp_tensor_to_float8_dynamic``), tensorwise or rowwise.

    ``amax = max(|x|)`` (NaN propagates; rowwise: per row along ``axis``), ``scale = fl32(fp8_max /
    max(amax, 1e-12))`` computed in float64, optionally rounded to a power of two in float32
    (:func:`torchao_round_down_to_power_of_2`); the cast is ``fp8(clamp(fl32(x * scale), +-max))``.
    An amax of 0 gives scale 448e12 (the epsilon), inf gives 0, NaN gives NaN.

    Attributes:
      fp8_format: ``fp8_e4m3fn`` or ``fp8_e5m2``.
      granularity: ``tensorwise`` or ``rowwise`` (torchao's AXISWISE).
      axis: rowwise: the dim reduced (torchao's ``axiswise_dim``; -1 scales each row).
      power_of_2: ``round_scales_to_power_of_2``.

    Example:
      >>> t = TorchaoScaling().quantize(np.array([[1.0, -2.0], [0.5, 4.0]], np.float32))
      >>> float(t.scale), t.values.ravel().tolist()
      (112.0, [112.0, -224.0, 56.0, 448.0])
      >>> rowwise = TorchaoScaling(granularity="rowwise")
      >>> rowwise.quantize(np.array([[1.0, -2.0], [0.5, 4.0]], np.float32)).scale.ravel().tolist()
      [224.0, 112.0]
    """

    fp8_format: str = "fp8_e4m3fn"
    granularity: str = "tensorwise"
    axis: int = -1
    power_of_2: bool = False

    def __post_init__(self):
        _check_choice(self.fp8_format, "fp8_format", FP8_FORMATS)
        _check_choice(self.granularity, "granularity", GRANULARITIES)
        _check_flag(self.power_of_2, "power_of_2")
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise ValueError(f"axis: expected an integer (a dim of the tensors scaled), got {self.axis!r}")

    def amax(self, x) -> np.ndarray:
        return torch_amax(x, None if self.granularity == "tensorwise" else self.axis)

    def scale_from_amax(self, amax) -> np.ndarray:
        """torchao's ``amax_to_scale``."""
        amax = np.asarray(amax, dtype=np.float32).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = (float(fp8_max(self.fp8_format)) / np.maximum(amax, TORCHAO_EPS)).astype(np.float32)
        return torchao_round_down_to_power_of_2(scale) if self.power_of_2 else scale

    def quantize(self, x) -> Fp8Tensor:
        """Cast ``x`` (float32, or bf16 widened exactly) to fp8 as ``hp_tensor_to_float8_dynamic`` does."""
        amax = self.amax(x)
        scale = self.scale_from_amax(amax)
        codes, values = cast_to_fp8(x, scale, self.fp8_format, "clamp")
        return Fp8Tensor(np.asarray(amax), np.asarray(scale), _reciprocal(scale), codes, values)

    def run(self, amaxes) -> "RecipeRun":
        """The scale of each step's amax (a tensorwise tensor per step)."""
        scales = [float(self.scale_from_amax(a)) for a in amaxes]
        return RecipeRun.of(amaxes, [float(_f32(a)) for a in amaxes], scales)


# --- a run over steps --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RecipeRun:
    """A recipe driven through one amax per step.

    Attributes:
      amax: each step's observed amax (float32).
      amax_used: the amax each step's scale came from (delayed scaling: from the history; TE's
        current scaling: after its epsilon floor; torchao: the amax itself, its 1e-12 clamp being
        inside ``amax_to_scale``).
      scale: the scale computed at each step (delayed scaling: the one the next step casts with).
      scale_inv: its float32 reciprocal.
    """

    amax: tuple
    amax_used: tuple
    scale: tuple
    scale_inv: tuple

    @classmethod
    def of(cls, amaxes, used, scales) -> "RecipeRun":
        """A run from its columns; scale_inv is fl32(1/scale), as TE's reciprocal computes it."""
        return cls(tuple(float(_f32(a)) for a in amaxes), tuple(used), tuple(scales),
                   tuple(float(v) for v in _reciprocal(np.array(scales, dtype=np.float32))))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One row of :data:`RECIPES`: a recipe model, the parameters that make it this recipe, its source.

    Attributes:
      model: the class (:class:`DelayedScaling`, :class:`CurrentScaling`, :class:`TorchaoScaling`).
      fixed: parameters the row sets (``path="unfused"``); the caller gives the others.
      source: where it was read from and how it was checked.
      departs: where its arithmetic departs from exact (a correctly rounded ``fp8_max / amax`` and one
        rounding of ``x * scale``), in words; reports/recipes/ counts how often.
    """

    model: type
    fixed: dict
    source: RecipeSource
    departs: str = ""

    def build(self, **params):
        clash = sorted(set(params) & set(self.fixed))
        if clash:
            raise ValueError(f"{', '.join(clash)}: set by the recipe itself ({self.fixed})")
        try:
            return self.model(**params, **self.fixed)
        except TypeError as error:
            raise ValueError(str(error).replace(".__init__()", "")) from None


_TE = "NVIDIA/TransformerEngine"
_TE_COMMIT = "d0067d0da6cb (2026-08-22)"
# The one table of recipe names; the trace specs, the adapters and the report take their names from it.
_TE_DELAYED_UNFUSED = ("pytorch/quantization.py (_amax_and_scale_update, _default_get_amax_and_update_history, "
                       "_default_sf_compute); common/recipe/__init__.py (DelayedScaling)")
_TORCHAO_FILES = ("float8/float8_utils.py (tensor_to_amax, amax_to_scale, _round_scale_down_to_power_of_2, "
                  "to_fp8_saturated), float8/float8_training_tensor.py, float8/float8_linear.py")
_PRODUCT = "x * scale is rounded to float32 before the fp8 cast (two roundings where one would do)"
_TORCHAO_DEPARTS = ("the amax is clamped at 1e-12, so a tensor with a smaller amax gets scale fp8_max * 1e12 and "
                    "quantizes to zeros; power-of-two rounding takes log2 in float32 and rounds up a few ulp "
                    f"below 2^k; NaN propagates (an inf amax gives scale 0, NaN scale NaN); {_PRODUCT}")
RECIPES = {
    "te_delayed": Recipe(DelayedScaling, {"path": "fused"}, RecipeSource(
        _TE, _TE_COMMIT, "common/recipe/delayed_scaling.cu (kernel_bulk)", "source-derived"),
        departs=f"one float32 division, correctly rounded; the history does not roll on a zero amax; fmaxf "
                f"leaves NaN out of the window; {_PRODUCT}"),
    "te_delayed_unfused": Recipe(DelayedScaling, {"path": "unfused"}, RecipeSource(
        _TE, _TE_COMMIT, _TE_DELAYED_UNFUSED, "driven"),
        departs="fp8_max / amax is torch's Tensor.__rtruediv__, fl32(fl32(1 / amax) * fp8_max): two roundings, "
                "off by one ulp for 27.9% of amaxes; with a margin the quotient can overflow before 2^margin "
                f"divides it; torch.max propagates NaN, freezing the scale for amax_history_len steps; {_PRODUCT}"),
    "te_current": Recipe(CurrentScaling, {"implementation": "kernel"}, RecipeSource(
        _TE, _TE_COMMIT, "common/recipe/recipe_common.cuh (compute_scale_from_amax), common/recipe/current_scaling.cu, "
        "common/utils.cuh (reciprocal: __frcp_rn)", "source-derived"),
        departs=f"one float32 division, correctly rounded; fmaxf leaves NaN out of the amax; an amax of 0, inf "
                f"or NaN gives scale 1; power-of-two scales are an exact floor (bit mask); {_PRODUCT}"),
    "te_current_reference": Recipe(CurrentScaling, {"implementation": "reference"}, RecipeSource(
        _TE, _TE_COMMIT, "pytorch/custom_recipes/reference_current_scaling.py (_scale_from_amax_tensor, "
        "CurrentScalingQuantizerRef.compute_scale and _quantize)", "driven"),
        departs=f"one float32 division; torch.amax propagates NaN (one NaN makes every code NaN); an inf amax "
                f"gives scale 0; power-of-two scales by frexp (exact); torch's eager e5m2 cast overflows to inf; "
                f"{_PRODUCT}"),
    "torchao_tensorwise": Recipe(TorchaoScaling, {"granularity": "tensorwise"}, RecipeSource(
        "pytorch/ao", "torchao 0.18.0", _TORCHAO_FILES, "driven"), departs=_TORCHAO_DEPARTS),
    "torchao_rowwise": Recipe(TorchaoScaling, {"granularity": "rowwise"}, RecipeSource(
        "pytorch/ao", "torchao 0.18.0", _TORCHAO_FILES, "driven"), departs="each row its own amax and scale; " + _TORCHAO_DEPARTS),
}


def make_recipe(name: str, **params):
    """The recipe model called ``name`` (a key of :data:`RECIPES`) with its parameters.

    Args:
      name: the recipe, e.g. ``te_delayed``.
      **params: the model's fields that the recipe's row does not set.

    Returns:
      A :class:`DelayedScaling`, :class:`CurrentScaling` or :class:`TorchaoScaling`.

    Raises:
      ValueError: an unknown recipe, a parameter the model lacks or the row sets, a value out of range.

    Example:
      >>> make_recipe("te_delayed_unfused", amax_history_len=3).path
      'unfused'
    """
    if name not in RECIPES:
        raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}, got {name!r}")
    return RECIPES[name].build(**params)


def simulate_recipe(amaxes, recipe: str, **params) -> RecipeRun:
    """Drive the recipe ``recipe`` through one amax per step (see :func:`make_recipe`).

    Args:
      amaxes: each step's amax (float32; 0, inf and NaN allowed).
      recipe: a key of :data:`RECIPES`.
      **params: the recipe's parameters.

    Returns:
      A :class:`RecipeRun`: per step the amax, the amax the scale came from, the scale and its inverse.

    Example:
      >>> nan = float("nan")
      >>> simulate_recipe([1.0, nan, 2.0, 2.0, 2.0], "te_delayed", amax_history_len=3).scale
      (448.0, 448.0, 224.0, 224.0, 224.0)
      >>> simulate_recipe([1.0, nan, 2.0, 2.0, 2.0], "te_delayed_unfused", amax_history_len=3).scale
      (448.0, 448.0, 448.0, 448.0, 224.0)
    """
    return make_recipe(recipe, **params).run(amaxes)
