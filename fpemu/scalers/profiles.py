"""Named profiles: each configures :class:`ScalerRules` to reproduce one real loss scaler.

A profile takes the implementation's own parameter names and defaults, records
the source it was read from, and says how it was verified: ``driven`` profiles
are compared bit for bit with the installed package by the test suite;
``source-derived`` ones are pinned by trajectories worked out from the source
(their packages do not install here).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from fpemu.scalers.model import F32_TINY, ScalerRules

REQUIRED = object()  # marks a parameter the real implementation has no default for
# The one vocabulary of a profile's unscale arithmetic and inf check (fpemu.unscale, step_overflowed).
PROFILE_CHOICES = {"verified": ("driven", "source-derived"),
                   "unscale": ("mul_recip_fp64", "mul_recip_fp32", "mul_recip_ftz", "divide", "none"),
                   "check_on": ("scaled", "unscaled", "grad_norm")}


@dataclasses.dataclass(frozen=True)
class Profile:
    """One real implementation's dynamic loss scaling.

    Attributes:
      name: profile name used by :func:`simulate_scaler`, specs and traces.
      implementation: the class or function reproduced.
      source: package, version read and file.
      verified: ``"driven"`` or ``"source-derived"``.
      defaults: the implementation's parameter names and defaults.
      build: maps the full parameter dict to :class:`ScalerRules`.
      unscale: ``"mul_recip_fp64"`` (g * float32(1/float64(s))), ``"mul_recip_fp32"``
        (g * (float32(1)/float32(s))), ``"mul_recip_ftz"`` (the same with x86's flush-to-zero and
        denormals-are-zero: CPU kernels of Paddle and TensorFlow), ``"divide"`` (g / s in float32)
        or ``"none"``.
      check_on: ``"scaled"`` or ``"unscaled"`` gradients, or ``"grad_norm"``.
      notes: behaviour worth knowing, in a sentence or two.
    """

    name: str
    implementation: str
    source: str
    verified: str
    defaults: dict
    build: Callable[[dict], ScalerRules]
    unscale: str
    check_on: str
    notes: str = ""

    def __post_init__(self):
        for name, choices in PROFILE_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"profile {self.name!r}: {name} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")
        unknown = sorted(set(self.defaults) - set(_PARAM_KINDS))
        if unknown:
            raise ValueError(f"profile {self.name!r}: parameters {', '.join(unknown)} have no kind in _PARAM_KINDS")

    def rules(self, **params) -> ScalerRules:
        """The rules for these parameters (the others take the profile's defaults)."""
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise TypeError(f"profile {self.name!r} has no parameter {', '.join(map(repr, unknown))}; "
                            f"its parameters are {', '.join(self.defaults)}")
        merged = {**self.defaults, **params}
        missing = [k for k, v in merged.items() if v is REQUIRED]
        if missing:
            raise TypeError(f"profile {self.name!r}: {self.implementation} has no default for "
                            f"{', '.join(missing)}; pass it")
        for key, value in merged.items():
            _check_param(self.name, key, value)
        return self.build(merged)


# What each implementation parameter is, across every profile (one table; values are checked by kind).
_PARAM_KINDS = {
    **dict.fromkeys(("init_scale", "loss_scale", "scale", "initial_scale", "init_loss_scaling"), "scale"),
    **dict.fromkeys(("growth_factor", "factor", "scale_factor", "incr_ratio"), "growth"),
    **dict.fromkeys(("backoff_factor", "decr_ratio"), "backoff"),
    "period": "period",
    **dict.fromkeys(("growth_interval", "dynamic_growth_steps", "scale_window", "incr_every_n_steps",
                     "decr_every_n_nan_or_inf", "delayed_shift", "hysteresis"), "interval"),
    **dict.fromkeys(("min_loss_scale", "min_scale", "minimum_scale", "threshold"), "bound"),
    "max_loss_scale": "cap",
    "tolerance": "share",
    "max_consecutive_errors": "count",
    **dict.fromkeys(("consecutive_hysteresis", "raise_error_at_min_scale"), "flag"),
}


def _check_param(profile: str, key: str, value) -> None:
    where = f"profile {profile!r}: {key}"
    kind = _PARAM_KINDS.get(key)
    if kind == "flag":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{where} must be true or false, got {value!r}")
        return
    if kind in ("interval", "count"):
        _check_param_count(where, value, kind)
        return
    if kind == "bound" and value is None:
        return
    if kind == "period":
        _check_period(where, value)
        return
    if kind == "cap":
        _check_cap(where, value)
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    if kind == "scale" and value <= 0:
        raise ValueError(f"{where} must be positive, got {value}")
    if kind == "growth" and value <= 1:
        raise ValueError(f"{where} must be greater than 1, got {value}")
    if kind == "backoff" and not 0 < value < 1:
        raise ValueError(f"{where} must be in (0, 1), got {value}")
    if kind in ("bound", "share") and value < 0:
        raise ValueError(f"{where} must be at least 0, got {value}")


def _check_param_count(where: str, value, kind: str) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where} must be an int, got {value!r}")
    if value < (1 if kind == "interval" else 0):
        raise ValueError(f"{where} must be at least {1 if kind == 'interval' else 0}, got {value}")


def _check_cap(where: str, value) -> None:
    # apex (4d6ed50) computes min(max_loss_scale, ...) and checks nothing: inf is no cap, None makes
    # min() raise TypeError, and a NaN or negative cap gives a NaN or negative scale.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where} must be a number or inf, got {value!r}")
    if not value >= 0:  # refuses NaN and -inf, takes +inf
        raise ValueError(f"{where} must be at least 0 or inf, got {value}")


# jmp's counter is int32, or float32 once period is a float; it counts integers exactly up to 2**24.
_FLOAT_PERIOD_MAX = 2**24


def _check_period(where: str, value) -> None:
    # jmp 0.0.4 never checks period (its tests pass 5.): counter == period - 1 and
    # (counter + 1) % period run in float32 for a float period.  An integer-valued one up to 2**24
    # counts as the int does; 2.5 would grow every 5th finite step with counters 0.5, 1.5, which
    # the traces' integer growth counter cannot hold, and past 2**24 counter + 1 rounds.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where} must be an int or a float with an integer value, got {value!r}")
    if isinstance(value, (float, np.floating)):
        if not (math.isfinite(value) and value == int(value)):
            raise ValueError(f"{where} must be an int or a float with an integer value, got {value!r} "
                             f"(jmp's float32 counter would count fractions)")
        if value > _FLOAT_PERIOD_MAX:
            raise ValueError(f"{where} must be at most 2**24 as a float (jmp's float32 counter + 1 "
                             f"rounds past it), got {value!r}; pass an int")
        value = int(value)
    _check_param_count(where, value, "interval")


def _torch(p):
    return ScalerRules(p["init_scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       arithmetic="fp64_to_fp32", on_growth_overflow="keep")


def _torch_sharded(p):
    return ScalerRules(p["init_scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       arithmetic="fp32", on_growth_overflow="inf")


def _jmp(p):
    # Under jit the state is flattened and rebuilt: min_loss_scale is not among the pytree's
    # fields, so the traced adjust floors at the dataclass default, 1.0, whatever was passed.
    return ScalerRules(p["loss_scale"], float(p["factor"]), growth_interval=int(p["period"]),
                       arithmetic="fp32", backoff="reciprocal", on_growth_overflow="keep",
                       floor=1.0, flush_subnormals=True,
                       flush_initial_scale=False)


def _jmp_eager(p):
    return ScalerRules(p["loss_scale"], float(p["factor"]), growth_interval=int(p["period"]),
                       arithmetic="fp32", backoff="divide", on_growth_overflow="keep",
                       floor=float(np.float32(p["min_loss_scale"])), flush_subnormals=True,
                       flush_initial_scale=False)


def _flax(p):
    floor = p["minimum_scale"]
    return ScalerRules(p["scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       growth_timing="N+1", arithmetic="fp32", on_growth_overflow="clamp",
                       floor=None if floor is None else float(np.float32(floor)), flush_subnormals=True,
                       at_zero_scale="overflow", flush_initial_scale=False)


def _keras(p):
    return ScalerRules(p["initial_scale"], 2.0, 0.5, p["dynamic_growth_steps"], arithmetic="fp32",
                       on_growth_overflow="inf", flush_subnormals=True)


def _tf_keras(p):
    # TF's CPU kernels flush subnormals, but the initial scale is stored as given.
    return ScalerRules(p["initial_scale"], 2.0, growth_interval=p["dynamic_growth_steps"], arithmetic="fp32",
                       backoff="divide", on_growth_overflow="keep", floor=1.0, flush_subnormals=True,
                       flush_initial_scale=False)


def _deepspeed_floor(p, key):
    # With a floor of 0 the scale halves to 0.0 and the next finite step's unscale (1. / scale, in
    # ZeRO and FP16_Optimizer alike) raises ZeroDivisionError; 0.19.8's fp16 config refuses it.
    if p[key] <= 0:
        raise ValueError(f"{key} must be positive (DeepSpeed divides by the scale; its fp16 config refuses "
                         f"min_loss_scale <= 0), got {p[key]!r}")
    return float(p[key])


def _deepspeed_loss_scaler(p, factor, timing):
    return ScalerRules(p["init_scale"], factor, growth_interval=p["scale_window"],
                       growth_timing=timing, arithmetic="python", backoff="divide",
                       on_growth_overflow="inf", floor=_deepspeed_floor(p, "min_scale"),
                       floor_action="raise" if p["raise_error_at_min_scale"] else "clamp",
                       hysteresis=p["delayed_shift"], hysteresis_style="deepspeed",
                       consecutive_hysteresis=p["consecutive_hysteresis"], overflow_at_inf_raises=True)


def _deepspeed(p):  # 0.17.1 on (PR #6976): the factor is fixed at 2, growth comes one good step later
    return _deepspeed_loss_scaler(p, 2.0, "window+1")


def _deepspeed_0_17(p):
    if all(isinstance(p[k], (int, np.integer)) for k in ("init_scale", "scale_factor")):
        # int * int stays an exact Python int in DeepSpeed (3 ** k * init, never rounded); the model
        # rounds each product to a float.
        raise TypeError(f"scale_factor must be a float when init_scale is an int (DeepSpeed would keep the "
                        f"scale an exact int), got {p['scale_factor']!r}")
    return _deepspeed_loss_scaler(p, p["scale_factor"], "window")


def _deepspeed_fp16_optimizer(p):
    return ScalerRules(p["init_scale"], 2.0, growth_interval=p["scale_window"],
                       growth_timing="window+1", arithmetic="python", backoff="divide",
                       on_growth_overflow="inf", floor=_deepspeed_floor(p, "min_loss_scale"))


def _megatron(p):
    if not 0 < p["min_scale"] <= p["initial_scale"]:  # DynamicGradScaler asserts both
        raise ValueError(f"profile 'megatron': min_scale must be in (0, initial_scale], got min_scale="
                         f"{p['min_scale']} with initial_scale={p['initial_scale']}")
    return ScalerRules(p["initial_scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       arithmetic="fp32", on_growth_overflow="inf",
                       floor=float(np.float32(p["min_scale"])), hysteresis=p["hysteresis"])


def _apex(p):
    return ScalerRules(min(p["max_loss_scale"], p["init_scale"]), 2.0, 0.5, p["scale_window"],
                       arithmetic="python", on_growth_overflow="inf", max_scale=p["max_loss_scale"],
                       floor=p["min_loss_scale"] or None, at_zero_scale="raise")


def _fairseq(p):
    if p["min_loss_scale"] is None:  # check_overflow compares loss_scale <= min_loss_scale on every overflow
        raise TypeError("profile 'fairseq': min_loss_scale must be a number (fairseq compares the scale with it "
                        "on every overflow: None raises TypeError), got None")
    return ScalerRules(p["init_scale"], p["scale_factor"], growth_interval=p["scale_window"],
                       growth_timing="window", arithmetic="python", backoff="divide",
                       on_growth_overflow="inf", floor=p["threshold"], stop_at=p["min_loss_scale"],
                       tolerance=p["tolerance"])


def _paddle(p, at_zero_scale="overflow"):
    # The GPU kernel checks the unscaled values: at a scale of 0 they are 0 * inf = NaN.
    return ScalerRules(p["init_loss_scaling"], p["incr_ratio"], p["decr_ratio"], p["incr_every_n_steps"],
                       arithmetic="fp32", on_growth_overflow="inf",
                       backoff_every=p["decr_every_n_nan_or_inf"], at_zero_scale=at_zero_scale)


def _paddle_cpu(p):
    # The CPU kernel checks the scaled gradients before unscaling, so a zero scale goes unnoticed.
    return _paddle(p, at_zero_scale="continue")


def _optax(p):
    return ScalerRules(1.0, dynamic=False, pass_after_consecutive=p["max_consecutive_errors"])


def _static(p):
    return ScalerRules(p["loss_scale"], dynamic=False, arithmetic="fp32")


def _megatron_constant(p):
    return ScalerRules(p["initial_scale"], dynamic=False, arithmetic="fp32")


_PADDLE_DEFAULTS = dict(init_loss_scaling=2.0**16, incr_ratio=2.0, decr_ratio=0.5, incr_every_n_steps=2000,
                        decr_every_n_nan_or_inf=1)

PROFILES = {profile.name: profile for profile in [
    Profile("torch", "torch.amp.GradScaler", "torch 2.13.0: torch/amp/grad_scaler.py, "
            "aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp (_amp_update_scale_)", "driven",
            dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000),
            _torch, "mul_recip_fp64", "scaled",
            "Grows on the N-th good step; scale*factor in float64 rounded once to float32; a growth "
            "that overflows keeps the old scale (counter still resets); no floor (can reach 0)."),
    Profile("torch_sharded", "torch.distributed.fsdp.ShardedGradScaler (CPU scale path)",
            "torch 2.13.0: torch/distributed/fsdp/sharded_grad_scaler.py (_amp_update_scale_cpu_)",
            "driven", dict(init_scale=2.0**16, backoff_factor=0.5, growth_factor=2.0, growth_interval=2000),
            _torch_sharded, "mul_recip_fp64", "scaled",
            "Positional order is backoff before growth; float32 multiply; growth can reach inf and "
            "never recovers."),
    Profile("jmp", "jmp.DynamicLossScale (adjust under jax.jit)", "jmp 0.0.4: jmp/_src/loss_scale.py",
            "driven", dict(loss_scale=REQUIRED, period=2000, factor=2, min_loss_scale=1.0),
            _jmp, "mul_recip_fp32", "unscaled",
            "Grows on N, keeps the old scale if growth overflows; backoff divides by factor, which XLA "
            "rewrites to a multiply by float32(1/factor) under jit; min_loss_scale is not a pytree field, "
            "so under jit it is dropped and the floor is 1.0 whatever was passed (min_loss_scale=0.3 "
            "gives 10, 5, 2.5, 1.25, 1, 1; see jmp_eager for the value honoured). period may be a float "
            "with an integer value up to 2^24 (jmp's tests pass 5.): its counter is then float32 and counts "
            "as the int does."),
    Profile("jmp_eager", "jmp.DynamicLossScale (adjust called eagerly, op by op)",
            "jmp 0.0.4: jmp/_src/loss_scale.py", "driven",
            dict(loss_scale=REQUIRED, period=2000, factor=2, min_loss_scale=1.0),
            _jmp_eager, "mul_recip_fp32", "unscaled",
            "As jmp, but outside jit: min_loss_scale is honoured and the backoff is a true float32 "
            "division (differs from jit's reciprocal multiply for factors that are not powers of two); "
            "each op is still compiled by XLA, so subnormal scales flush to zero."),
    Profile("flax", "flax.training.dynamic_scale.DynamicScale (under jax.jit)",
            "flax 0.12.8: flax/training/dynamic_scale.py", "driven",
            dict(scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 minimum_scale=F32_TINY),
            _flax, "divide", "unscaled",
            "Grows on the (N+1)-th good step; clamps growth to float32 max; floors at float32 tiny; "
            "checks the unscaled gradients; XLA flushes subnormals."),
    Profile("keras", "keras.optimizers.LossScaleOptimizer (Keras 3, JAX backend, stateless_apply)",
            "keras 3.15.1: keras/src/optimizers/loss_scale_optimizer.py", "driven",
            dict(initial_scale=2.0**15, dynamic_growth_steps=2000), _keras, "divide", "scaled",
            "Factors fixed at 2 and 0.5; no floor, no cap: growth can reach inf and stay there."),
    Profile("tf_keras", "tf_keras.mixed_precision.LossScaleOptimizer (V3 and legacy, eager, CPU)",
            "tf-keras 2.21.0 on tensorflow 2.21.0: tf_keras/src/mixed_precision/loss_scale_optimizer.py "
            "(_DynamicLossScaleState)", "driven", dict(initial_scale=2.0**15, dynamic_growth_steps=2000),
            _tf_keras, "mul_recip_ftz", "unscaled",
            "Grows on N (counter + 1 >= steps); keeps the old scale if growth overflows; backoff "
            "max(scale / 2, 1). TensorFlow's CPU kernels flush subnormals: unscaled gradients (and a "
            "subnormal initial scale's first growth, which gives 0)."),
    Profile("deepspeed", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (ZeRO 1-3; engine config defaults)",
            "DeepSpeed from PR #6976 (e440506be; every 0.17.1 release on), driven against 0.19.8 and a source "
            "build of e440506be: deepspeed/runtime/fp16/loss_scaler.py, runtime/precision_config.py", "driven",
            dict(init_scale=2.0**16, scale_window=1000, min_scale=1,
                 delayed_shift=2, consecutive_hysteresis=False, raise_error_at_min_scale=True),
            _deepspeed, "mul_recip_fp64", "scaled",
            "For DeepSpeed from PR #6976 (released in 0.17.1; a source build from before it already says "
            "0.17.1 and follows deepspeed_0_17: the adapters ask the class, not the version). Grows when (steps since the last overflow) - 1 is a positive "
            "multiple of the window: the first growth after an overflow, and at the start, comes on the "
            "(N+1)-th good step, later ones every N; the factor is fixed at 2 and the class has no defaults "
            "(these are the engine's fp16 config defaults, which it always passes); hysteresis "
            "(delayed_shift) refills on growth; raises on an overflow at min_scale, and on an overflow "
            "once the Python-float scale has grown to inf (int(inf) in its log line); ZeRO unscales with "
            "the scale after its update."),
    Profile("deepspeed_0_17", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (ZeRO 1-3; engine config "
            "defaults), DeepSpeed <= 0.17.0",
            "DeepSpeed <= 0.17.0 and source builds before PR #6976 (which say 0.17.1), driven against 0.17.0 and "
            "a source build of e440506be^: deepspeed/runtime/fp16/loss_scaler.py, runtime/config.py",
            "driven",
            dict(init_scale=2.0**16, scale_factor=2.0, scale_window=1000, min_scale=1,
                 delayed_shift=2, consecutive_hysteresis=False, raise_error_at_min_scale=True),
            _deepspeed_0_17, "mul_recip_fp64", "scaled",
            "For DeepSpeed up to 0.17.0 and source builds before PR #6976. Grows when the steps since the last overflow are a multiple "
            "of the window; scale_factor is an argument; otherwise as the deepspeed profile. The engine "
            "passes these config defaults only when the fp16 config names one of its dynamic-scale keys "
            "(else see deepspeed_legacy)."),
    Profile("deepspeed_legacy", "DeepSpeed DynamicLossScaler with its class defaults, DeepSpeed <= 0.17.0",
            "DeepSpeed <= 0.17.0, driven against 0.17.0: deepspeed/runtime/fp16/loss_scaler.py", "driven",
            dict(init_scale=2.0**32, scale_factor=2.0, scale_window=1000, min_scale=1,
                 delayed_shift=1, consecutive_hysteresis=False, raise_error_at_min_scale=True),
            _deepspeed_0_17, "mul_recip_fp64", "scaled",
            "For DeepSpeed up to 0.17.0 (0.17.1 removed the class defaults): what its ZeRO built from an "
            "fp16 config without dynamic-scale keys: 2^32 and no hysteresis; growth as deepspeed_0_17."),
    Profile("deepspeed_fp16_optimizer", "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer._update_scale",
            "DeepSpeed, driven against 0.17.0 and 0.19.8: deepspeed/runtime/fp16/fused_optimizer.py "
            "(unfused_optimizer.py's FP16_UnfusedOptimizer, ZeRO-0 with a torch optimizer, has the same rule)",
            "driven",
            dict(init_scale=2.0**16, scale_window=1000, min_loss_scale=1),
            _deepspeed_fp16_optimizer, "mul_recip_fp64", "scaled",
            "The same in 0.17.0 and 0.19.8. stable_interval rule: the first growth after an overflow (and at "
            "the start) comes on the (N+1)-th good step, later ones every N; factor fixed at 2; floor "
            "without raising; no hysteresis; unscales with the scale after its update."),
    Profile("megatron", "megatron.core.optimizer.grad_scaler.DynamicGradScaler",
            "megatron-core 0.16.1 (driven; 0.19.2 differs in docstrings only): "
            "megatron/core/optimizer/grad_scaler.py, defaults from optimizer_config.py", "driven",
            dict(initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=2),
            _megatron, "mul_recip_fp64", "scaled",
            "float32 tensors; hysteresis refills only at growth, so after it is spent every "
            "overflow backs off; growth can reach inf. The class has no defaults and asserts "
            "0 < min_scale <= initial_scale; these are OptimizerConfig's (growth 2, backoff 0.5 fixed by "
            "get_megatron_optimizer)."),
    Profile("megatron_constant", "megatron.core.optimizer.grad_scaler.ConstantGradScaler",
            "megatron-core 0.16.1 (driven): megatron/core/optimizer/grad_scaler.py", "driven",
            dict(initial_scale=REQUIRED), _megatron_constant, "mul_recip_fp64", "scaled",
            "OptimizerConfig.loss_scale set: the float32 scale never changes; megatron's optimizer skips "
            "every overflowing step."),
    Profile("apex", "apex.amp.scaler.LossScaler", "NVIDIA/apex at 4d6ed50 (last change to the file, 2019-08; amp removed in cb65b8e, 2025-05-08): "
            "apex/amp/scaler.py; not installable here (not on PyPI, needs CUDA to build)",
            "source-derived", dict(init_scale=2.0**16, scale_window=2000, min_loss_scale=None,
                                   max_loss_scale=2.0**24),
            _apex, "mul_recip_fp64", "scaled",
            "Factor fixed at 2 (its argument is ignored); hard cap max_loss_scale = 2^24 (inf: no cap, the "
            "scale can double to inf and stays there); floor only "
            "if min_loss_scale is set (a falsy 0 is none); Python floats, so the scale halves through "
            "the subnormal doubles to exactly 0.0, and the next unscale's 1./scale raises "
            "ZeroDivisionError (training stops)."),
    Profile("fairseq", "fairseq.optim.dynamic_loss_scaler.DynamicLossScaler",
            "fairseq v0.12.2 (the last release; main at 3d262bb has the same file): "
            "fairseq/optim/dynamic_loss_scaler.py; not installable here (the 0.12.2 sdist lacks a C++ source, import fails on Python 3.11)", "source-derived",
            dict(init_scale=2.0**15, scale_factor=2.0, scale_window=2000, tolerance=0.0,
                 threshold=None, min_loss_scale=1e-4),
            _fairseq, "mul_recip_fp64", "grad_norm",
            "Backs off only when the share of overflows since the last rescale reaches tolerance; "
            "raises FloatingPointError (training stops, scale restored) on any overflow after which the "
            "scale is at or below min_loss_scale, even one that tolerance kept from backing off."),
    Profile("paddle", "paddle.amp.GradScaler (dygraph) on a GPU",
            "Paddle 3.3.1: python/paddle/amp/grad_scaler.py; GPU kernel check_finite_and_unscale "
            "(phi/kernels/gpu/amp_kernel.cu)", "source-derived", _PADDLE_DEFAULTS,
            _paddle, "mul_recip_fp32", "unscaled",
            "Where GradScaler enables itself (GPU, XPU, custom devices). Grows on the N-th good step; "
            "backs off after decr_every_n_nan_or_inf consecutive bad steps; float32 multiplies by "
            "float32(factor); no floor, no cap (growth can reach inf). The kernel multiplies by 1/scale "
            "and checks the unscaled, narrowed values: a scale of 0 makes every step an overflow. The "
            "state machine is the one driven on the CPU (paddle_cpu)."),
    Profile("paddle_cpu", "paddle.amp.GradScaler (dygraph) on the CPU, forced on",
            "Paddle 3.3.1: python/paddle/amp/grad_scaler.py; CPU kernel check_finite_and_unscale "
            "(phi/kernels/cpu/amp_kernel.cc)", "driven", _PADDLE_DEFAULTS,
            _paddle_cpu, "mul_recip_ftz", "scaled",
            "GradScaler switches itself off on the CPU unless forced on, and scales dynamically only "
            "under auto_cast(dtype='float16'). The state machine of paddle, but the CPU kernel checks the "
            "scaled gradients before unscaling (a zero scale, or a finite value that unscales to inf, "
            "reaches the optimizer) and runs with denormals flushed: subnormal gradients and scales read "
            "as 0, a subnormal 1/scale and subnormal results become 0. The scale itself is not flushed. "
            "With a non-finite scaled gradient the kernel writes x * 0 instead (the step is skipped)."),
    Profile("optax", "optax.apply_if_finite", "optax 0.2.8: optax/transforms/_conditionality.py",
            "driven", dict(max_consecutive_errors=REQUIRED), _optax, "none", "unscaled",
            "No loss scale: rejects non-finite updates, but lets the (K+1)-th and every later "
            "consecutive non-finite update through until a finite one resets the count."),
    Profile("static", "a constant loss scale that skips non-finite steps", "fpemu", "driven",
            dict(loss_scale=1.0), _static, "mul_recip_fp64", "scaled",
            "The scale never changes; overflowing steps are skipped."),
]}


def get_profile(name) -> Profile:
    """The profile called ``name``; the error lists the known ones."""
    if isinstance(name, Profile):
        return name
    if name not in PROFILES:
        raise ValueError(f"profile: unknown profile {name!r}; known profiles: {', '.join(PROFILES)}")
    return PROFILES[name]
