"""Precision policies as data: which format each op of a training step computes in, and how it rounds.

A :class:`Policy` is a frozen value.  Its ``placement`` says how ops are placed:

* ``autocast``: torch autocast's own op table for ``table_device`` (``cuda`` or ``cpu``), read off the
  installed torch's dispatcher (:func:`fpemu.emulate.op_table`): ops it runs low compute in float32
  and round once to ``compute``; ops it runs in float32 stay float32; promoting ops and every other op
  follow torch's type promotion of the (emulated) dtypes they receive.  ``compute`` is fp16 or bf16.
* ``pure``: every floating op, forward and backward, rounds its inputs and its result to ``compute``
  (any fpemu format); the optimizer step updates float32 master weights.
* ``fp8``: the matrix products (``GEMM_OPS``) read their operands quantized to ``compute`` in the
  forward pass and to ``backward`` in the backward pass, each tensor with its own scale; every other
  op stays float32.  ``fp8_scaling="current"``: a power-of-two scale from the tensor's own amax (it
  maps to at most the format's max finite).  ``"delayed"``: Transformer Engine's delayed scaling,
  :class:`fpemu.scalers.fp8_recipes.DelayedScaling`: the scale of a tensor comes from the amax
  history of the same tensor in earlier steps (its module, op, operand and order in the pass); the
  histories live as long as the ``emulate_torch`` context (run every step inside one, as the
  loss-scale loop does).
* ``program``: the dtypes the program itself gives each result (JAX: the jaxpr's output dtypes, bf16,
  fp16, float8 types), every narrower result rounded once; ``compute`` is not used (fp32).

The core of this module imports neither torch nor JAX: a JAX emulator reads the same policies.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from fpemu.errors import FpemuInputError
from fpemu.formats import OVERFLOW_MODES, ROUNDING_MODES, Format, get_format
from fpemu.scalers import get_profile

# The emulators that place ops each way: torch's mode decides dtypes itself; a jaxpr states its own.
PLACEMENT_FRAMEWORKS = {"autocast": ("torch",), "pure": ("torch",), "fp8": ("torch",), "program": ("jax",)}
PLACEMENTS = tuple(PLACEMENT_FRAMEWORKS)
FP8_SCALINGS = ("current", "delayed")
ACCUMULATIONS = ("fp32", "low")
TABLE_DEVICES = ("cuda", "cpu")
# The matrix products fp8 places (aten overload packets, as torch names them below autograd), and the
# arguments each multiplies: the others (a bias, the addend of addmm) stay in float32.
GEMM_OPS = {"mm": ("self", "mat2"), "addmm": ("mat1", "mat2"), "bmm": ("self", "mat2"),
            "baddbmm": ("batch1", "batch2"), "convolution": ("input", "weight"),
            "convolution_backward": ("grad_output", "input", "weight")}


@dataclasses.dataclass(frozen=True)
class Policy:
    """How an emulated training step computes.

    Args:
      name: how traces and reports name it.
      placement: ``autocast``, ``pure`` or ``fp8`` (see the module docstring).
      compute: the low format (a :class:`Format` or name); fp8's forward format.
      backward: fp8's backward format (None: ``compute``).
      table_device: ``autocast``'s table: ``cuda`` (AutocastCUDA) or ``cpu`` (AutocastCPU).
      rounding, overflow, subnormals: how results round to the low format (as :func:`fpemu.quantize`).
      accumulation: ``fp32`` (matmuls and sums accumulate in float32 and round once, as cuBLAS and
        CUDA reductions do by default) or ``low`` (their running sum is rounded to the low format
        after every ``accumulation_block`` terms of the reduced dimension: matrix products, sums,
        means, convolutions; other accumulating ops are refused, see ``_torch_accumulation``).
      accumulation_block: terms per rounding of the running sum under ``low`` accumulation.
      update_rounding: None: the optimizer updates float32 master weights.  A rounding mode (e.g.
        ``stochastic``): after each optimizer step the weights are rounded to ``compute`` that way
        (low-precision weights without a master copy, with stochastic rounding of the update).
      seed: seed of stochastic rounding (each rounding call draws from its own stream).
      fp8_scaling: ``current`` or ``delayed`` (fp8 placement; see the module docstring).
      amax_history_len, amax_compute_algo, fp8_margin: delayed scaling's history length, ``max`` or
        ``most_recent``, and margin (as Transformer Engine's ``DelayedScaling`` recipe; its defaults).

    Example:
      >>> p = get_policy("pure_bf16", rounding="toward_zero")
      >>> p.placement, p.compute.name, p.rounding
      ('pure', 'bf16', 'toward_zero')
    """

    name: str
    placement: str
    compute: Format
    backward: Optional[Format] = None
    table_device: Optional[str] = None
    rounding: str = "nearest_even"
    overflow: str = "inf"
    subnormals: bool = True
    accumulation: str = "fp32"
    accumulation_block: int = 1
    update_rounding: Optional[str] = None
    seed: int = 0
    fp8_scaling: str = "current"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_margin: int = 0

    def __post_init__(self):
        object.__setattr__(self, "compute", _format(self.compute, "compute"))
        if self.backward is not None:
            object.__setattr__(self, "backward", _format(self.backward, "backward"))
        _choice("placement", self.placement, PLACEMENTS)
        _choice("rounding", self.rounding, ROUNDING_MODES)
        _choice("overflow", self.overflow, OVERFLOW_MODES)
        _choice("accumulation", self.accumulation, ACCUMULATIONS)
        if self.update_rounding is not None:
            _choice("update_rounding", self.update_rounding, ROUNDING_MODES)
        if not isinstance(self.subnormals, bool):
            raise FpemuInputError(f"policy {self.name}: subnormals must be True or False, got {self.subnormals!r}")
        for field in ("accumulation_block", "seed"):
            value = getattr(self, field)
            least = 1 if field == "accumulation_block" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise FpemuInputError(f"policy {self.name}: {field} must be an int >= {least}, got {value!r}")
        if self.placement == "fp8" and self.accumulation == "low":
            raise FpemuInputError(f"policy {self.name}: accumulation='low' applies to the autocast and pure "
                                  "placements; fp8 GEMMs accumulate in float32 (their operands are fp8)")
        _choice("fp8_scaling", self.fp8_scaling, FP8_SCALINGS)
        if self.fp8_scaling == "delayed":
            if self.placement != "fp8":
                raise FpemuInputError(f"policy {self.name}: fp8_scaling='delayed' applies to placement 'fp8', "
                                      f"not {self.placement!r}")
            self.delayed_scaling(self.compute)  # the recipe checks its fields and formats
            self.delayed_scaling(self.backward_format)
        if self.placement == "autocast":
            _choice("table_device", self.table_device, TABLE_DEVICES)
            if self.compute.name not in ("fp16", "bf16"):
                raise FpemuInputError(f"policy {self.name}: autocast placement computes in fp16 or bf16 (the dtypes "
                                      f"torch's autocast casts to), got compute={self.compute.name}; use placement "
                                      "'pure' for other formats")

    @property
    def backward_format(self) -> Format:
        return self.backward or self.compute

    def delayed_scaling(self, fmt: Format):
        """The :class:`DelayedScaling` recipe of operands cast to ``fmt`` (``compute`` or ``backward``).

        Raises:
          FpemuInputError: a format the recipe does not take, or a bad history length, algo or margin.
        """
        from fpemu.scalers.fp8_recipes import DelayedScaling
        try:
            return DelayedScaling(fp8_format=fmt.name, margin=self.fp8_margin, amax_history_len=self.amax_history_len,
                                  amax_compute_algo=self.amax_compute_algo)
        except ValueError as error:
            raise FpemuInputError(f"policy {self.name}: delayed fp8 scaling: {error}") from None

    def describe(self) -> dict:
        """The policy as plain JSON values (formats by name and layout), for traces."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = _format_record(value) if isinstance(value, Format) else value
        return out


def _format(value, field: str) -> Format:
    try:
        return get_format(value)
    except (ValueError, TypeError) as error:
        raise FpemuInputError(f"policy {field}: {error}") from None


def _format_record(fmt: Format) -> dict:
    return {"name": fmt.name, "exponent_bits": fmt.exponent_bits, "mantissa_bits": fmt.mantissa_bits,
            "bias": fmt.bias, "special": fmt.special}


def _choice(field: str, value, choices) -> None:
    if value not in choices:
        raise FpemuInputError(f"policy {field} must be one of {', '.join(map(str, choices))}, got {value!r}")


# The named policies; every other field takes the Policy default.  Adding one is one row.
POLICIES = {
    "cuda_autocast_fp16": dict(placement="autocast", compute="fp16", table_device="cuda"),
    "cuda_autocast_bf16": dict(placement="autocast", compute="bf16", table_device="cuda"),
    "cpu_autocast_fp16": dict(placement="autocast", compute="fp16", table_device="cpu"),
    "cpu_autocast_bf16": dict(placement="autocast", compute="bf16", table_device="cpu"),
    "pure_fp16": dict(placement="pure", compute="fp16"),
    "pure_bf16": dict(placement="pure", compute="bf16"),
    "fp8": dict(placement="fp8", compute="fp8_e4m3fn", backward="fp8_e5m2"),
    # Transformer Engine's delayed scaling, whose cast kernels saturate
    "fp8_delayed": dict(placement="fp8", compute="fp8_e4m3fn", backward="fp8_e5m2", fp8_scaling="delayed",
                        overflow="saturate"),
    "program": dict(placement="program", compute="fp32"),
}


def check_framework(policy: Policy, framework: str) -> None:
    """Refuse a policy whose placement ``framework``'s emulator does not implement (``PLACEMENT_FRAMEWORKS``).

    Raises:
      FpemuInputError: naming the policy, its placement and the placements the framework takes.

    Example:
      >>> check_framework(get_policy("program"), "jax")
    """
    if framework not in PLACEMENT_FRAMEWORKS[policy.placement]:
        takes = [p for p, frameworks in PLACEMENT_FRAMEWORKS.items() if framework in frameworks]
        raise FpemuInputError(f"policy {policy.name}: placement {policy.placement} is not one {framework} emulates; "
                              f"{framework} takes placement {', '.join(takes)}")


def get_policy(policy="cuda_autocast_fp16", **overrides) -> Policy:
    """A named policy (``POLICIES``), or a Policy passed through, with fields replaced.

    Args:
      policy: a name from ``POLICIES`` or a :class:`Policy`.
      overrides: Policy fields (``compute="fp8_e5m2"``, ``rounding="stochastic"``, ``subnormals=False``, ...).

    Raises:
      FpemuInputError: an unknown name or field, or a value a field does not take.

    Example:
      >>> get_policy("fp8").backward_format.name
      'fp8_e5m2'
    """
    fields = {field.name for field in dataclasses.fields(Policy)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise FpemuInputError(f"policy has no field {', '.join(unknown)}; its fields are {', '.join(sorted(fields))}")
    if isinstance(policy, Policy):
        return dataclasses.replace(policy, **overrides) if overrides else policy
    if policy not in POLICIES:
        raise FpemuInputError(f"unknown policy {policy!r}; known policies: {', '.join(POLICIES)}")
    return Policy(**{"name": policy, **POLICIES[policy], **overrides})


def scaler_rules(profile: str, params: Optional[dict] = None) -> tuple:
    """The scaler an emulated loop runs: (the profile named ``profile``, its rules under ``params``).

    Args:
      profile: a scaler profile name (``torch``, ``flax``, ``deepspeed``, ...).
      params: that implementation's own parameters (``init_scale``, ``growth_interval``, ...).

    Returns:
      (Profile, ScalerRules); an unknown profile or parameter raises FpemuInputError naming the scaler.
    """
    try:
        chosen = get_profile(profile)
        return chosen, chosen.rules(**(params or {}))
    except (ValueError, TypeError) as error:  # an unknown profile or parameter: the user's input
        raise FpemuInputError(f"scaler {profile}: {error}") from None
