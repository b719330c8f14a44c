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
from typing import Callable, Optional

import numpy as np

from fpemu.scalers.model import F32_TINY, ScalerRules

REQUIRED = object()  # marks a parameter the real implementation has no default for


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
        (g * (float32(1)/float32(s))), ``"divide"`` (g / s in float32) or ``"none"``.
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


_SCALE_PARAMS = {"init_scale", "loss_scale", "scale", "initial_scale", "init_loss_scaling"}
_GROWTH_PARAMS = {"growth_factor", "factor", "scale_factor", "incr_ratio"}
_BACKOFF_PARAMS = {"backoff_factor", "decr_ratio"}
_INTERVAL_PARAMS = {"growth_interval", "period", "dynamic_growth_steps", "scale_window",
                    "incr_every_n_steps", "decr_every_n_nan_or_inf", "delayed_shift", "hysteresis"}


def _check_param(profile: str, key: str, value) -> None:
    where = f"profile {profile!r}: {key}"
    if key in _SCALE_PARAMS | _GROWTH_PARAMS | _BACKOFF_PARAMS:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{where} must be finite, got {value}")
    if key in _SCALE_PARAMS and value <= 0:
        raise ValueError(f"{where} must be positive, got {value}")
    if key in _GROWTH_PARAMS and value <= 1:
        raise ValueError(f"{where} must be greater than 1, got {value}")
    if key in _BACKOFF_PARAMS and not 0 < value < 1:
        raise ValueError(f"{where} must be in (0, 1), got {value}")
    if key in _INTERVAL_PARAMS:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{where} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{where} must be at least 1, got {value}")


def _torch(p):
    return ScalerRules(p["init_scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       arithmetic="fp64_to_fp32", on_growth_overflow="keep")


def _torch_sharded(p):
    return ScalerRules(p["init_scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       arithmetic="fp32", on_growth_overflow="inf")


def _jmp(p):
    return ScalerRules(p["loss_scale"], float(p["factor"]), growth_interval=p["period"],
                       arithmetic="fp32", backoff="reciprocal", on_growth_overflow="keep",
                       floor=float(np.float32(p["min_loss_scale"])), flush_subnormals=True)


def _flax(p):
    floor = p["minimum_scale"]
    return ScalerRules(p["scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       growth_timing="N+1", arithmetic="fp32", on_growth_overflow="clamp",
                       floor=None if floor is None else float(np.float32(floor)), flush_subnormals=True,
                       zero_scale_is_overflow=True)


def _keras(p):
    return ScalerRules(p["initial_scale"], 2.0, 0.5, p["dynamic_growth_steps"], arithmetic="fp32",
                       on_growth_overflow="inf", flush_subnormals=True)


def _tf_keras(p):
    return ScalerRules(p["initial_scale"], 2.0, growth_interval=p["dynamic_growth_steps"], arithmetic="fp32",
                       backoff="divide", on_growth_overflow="keep", floor=1.0)


def _deepspeed(p):
    return ScalerRules(p["init_scale"], p["scale_factor"], growth_interval=p["scale_window"],
                       growth_timing="window", arithmetic="python", backoff="divide",
                       on_growth_overflow="inf", floor=float(p["min_scale"]),
                       floor_action="raise" if p["raise_error_at_min_scale"] else "clamp",
                       hysteresis=p["delayed_shift"], hysteresis_style="deepspeed",
                       consecutive_hysteresis=p["consecutive_hysteresis"])


def _deepspeed_fp16_optimizer(p):
    return ScalerRules(p["init_scale"], p["scale_factor"], growth_interval=p["scale_window"],
                       growth_timing="window+1", arithmetic="python", backoff="divide",
                       on_growth_overflow="inf", floor=float(p["min_loss_scale"]))


def _megatron(p):
    return ScalerRules(p["initial_scale"], p["growth_factor"], p["backoff_factor"], p["growth_interval"],
                       arithmetic="fp32", on_growth_overflow="inf",
                       floor=float(np.float32(p["min_scale"])), hysteresis=p["hysteresis"])


def _apex(p):
    return ScalerRules(min(p["max_loss_scale"], p["init_scale"]), 2.0, 0.5, p["scale_window"],
                       arithmetic="python", on_growth_overflow="inf", max_scale=p["max_loss_scale"],
                       floor=p["min_loss_scale"] or None)


def _fairseq(p):
    return ScalerRules(p["init_scale"], p["scale_factor"], growth_interval=p["scale_window"],
                       growth_timing="window", arithmetic="python", backoff="divide",
                       on_growth_overflow="inf", floor=p["threshold"], stop_at=p["min_loss_scale"],
                       tolerance=p["tolerance"])


def _paddle(p):
    return ScalerRules(p["init_loss_scaling"], p["incr_ratio"], p["decr_ratio"], p["incr_every_n_steps"],
                       arithmetic="fp32", on_growth_overflow="inf",
                       backoff_every=p["decr_every_n_nan_or_inf"])


def _optax(p):
    return ScalerRules(1.0, dynamic=False, pass_after_consecutive=p["max_consecutive_errors"])


def _static(p):
    return ScalerRules(p["loss_scale"], dynamic=False, arithmetic="fp32")


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
            "rewrites to a multiply by float32(1/factor) under jit; min_loss_scale is dropped on any "
            "pytree round trip (jit included) and falls back to 1.0."),
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
    Profile("tf_keras", "tf_keras.mixed_precision.LossScaleOptimizer",
            "tf_keras: tf_keras/src/mixed_precision/loss_scale_optimizer.py (_DynamicLossScaleState)",
            "source-derived", dict(initial_scale=2.0**15, dynamic_growth_steps=2000), _tf_keras,
            "mul_recip_fp32", "unscaled",
            "Grows on N (counter + 1 >= steps); keeps the old scale if growth overflows; backoff "
            "max(scale / 2, 1)."),
    Profile("deepspeed", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (engine config defaults)",
            "DeepSpeed source as of 2025-02-21: deepspeed/runtime/fp16/loss_scaler.py, runtime/config.py",
            "source-derived",
            dict(init_scale=2.0**16, scale_factor=2.0, scale_window=1000, min_scale=1,
                 delayed_shift=2, consecutive_hysteresis=False, raise_error_at_min_scale=True),
            _deepspeed, "mul_recip_fp64", "scaled",
            "Grows when the steps since the last overflow are a multiple of the window; hysteresis "
            "(delayed_shift) refills on growth; raises on an overflow at min_scale; Python floats; "
            "unscales with the scale after its update."),
    Profile("deepspeed_legacy", "DeepSpeed DynamicLossScaler with its class defaults",
            "DeepSpeed source 2021-2023: deepspeed/runtime/fp16/loss_scaler.py", "source-derived",
            dict(init_scale=2.0**32, scale_factor=2.0, scale_window=1000, min_scale=1,
                 delayed_shift=1, consecutive_hysteresis=False, raise_error_at_min_scale=True),
            _deepspeed, "mul_recip_fp64", "scaled",
            "The class defaults ZeRO used without a dynamic fp16 config: 2^32 and no hysteresis."),
    Profile("deepspeed_fp16_optimizer", "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer._update_scale",
            "DeepSpeed source as of 2025-02-21: deepspeed/runtime/fp16/fused_optimizer.py", "source-derived",
            dict(init_scale=2.0**16, scale_factor=2.0, scale_window=1000, min_loss_scale=1),
            _deepspeed_fp16_optimizer, "mul_recip_fp64", "scaled",
            "stable_interval rule: the first growth after an overflow (and at the start) comes on "
            "the (N+1)-th good step, later ones every N; floor without raising; no hysteresis."),
    Profile("megatron", "megatron.core.optimizer.grad_scaler.DynamicGradScaler",
            "Megatron-LM 2026-08: megatron/core/optimizer/grad_scaler.py", "source-derived",
            dict(initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=2),
            _megatron, "mul_recip_fp64", "scaled",
            "float32 tensors; hysteresis refills only at growth, so after it is spent every "
            "overflow backs off; growth can reach inf."),
    Profile("apex", "apex.amp.scaler.LossScaler", "apex before amp's removal (2025-05-08): apex/amp/scaler.py",
            "source-derived", dict(init_scale=2.0**16, scale_window=2000, min_loss_scale=None,
                                   max_loss_scale=2.0**24),
            _apex, "mul_recip_fp64", "scaled",
            "Factor fixed at 2 (its argument is ignored); hard cap max_loss_scale = 2^24; floor only "
            "if min_loss_scale is set; Python floats."),
    Profile("fairseq", "fairseq.optim.dynamic_loss_scaler.DynamicLossScaler",
            "fairseq 2025-09: fairseq/optim/dynamic_loss_scaler.py", "source-derived",
            dict(init_scale=2.0**15, scale_factor=2.0, scale_window=2000, tolerance=0.0,
                 threshold=None, min_loss_scale=1e-4),
            _fairseq, "mul_recip_fp64", "grad_norm",
            "Backs off only when the share of overflows since the last rescale reaches tolerance; "
            "raises (training stops) when the scale falls to min_loss_scale."),
    Profile("paddle", "paddle.amp.GradScaler (dygraph)", "Paddle: python/paddle/amp/grad_scaler.py",
            "source-derived", dict(init_loss_scaling=2.0**16, incr_ratio=2.0, decr_ratio=0.5,
                                   incr_every_n_steps=2000, decr_every_n_nan_or_inf=1),
            _paddle, "mul_recip_fp64", "unscaled",
            "Backs off after decr_every_n_nan_or_inf consecutive bad steps; no floor, no cap."),
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
