"""megatron-core's grad scalers (DynamicGradScaler, ConstantGradScaler), driven for real.

The scalers keep their state in float32 tensors they allocate with ``device='cuda'``.
Where the adapter runs on the CPU, a TorchFunctionMode hands those allocations the
CPU device instead; the package itself is not touched.

The scalers only keep the scale: the optimizer decides about the step.  Megatron's
``MixedPrecisionOptimizer.step`` returns without updating whenever ``found_inf`` is
set (megatron/core/optimizer/optimizer.py), for both scalers, so a step is applied
exactly when it did not overflow.
"""

from __future__ import annotations

import dataclasses

from fpemu.adapters.observed import observed_trace
from fpemu.scalers.profiles import get_profile

DEVICES = ("cpu", "cuda")


def _on_device(device):
    """A TorchFunctionMode that moves megatron's ``device='cuda'`` allocations to ``device``."""
    from torch.overrides import TorchFunctionMode

    class CudaTo(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = device
            return func(*args, **kwargs)

    return CudaTo()


def _cuda_typed():
    """A TorchFunctionMode under which a CPU tensor's ``type()`` names its CUDA twin.

    Float16OptimizerWithFloat16Params (megatron-core 0.16.1, optimizer.py) sorts its parameters by
    ``param.type()`` and raises TypeError for anything but ``torch.cuda.{Half,BFloat16,Float}Tensor``;
    nothing else on its CPU path needs CUDA (the found-inf all-reduce, the unscale, the copies run on
    CPU tensors), so the multi-rank adapter builds it under this mode (with :func:`_on_device`) and
    runs it as it is.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaTyped(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            named = func(*args, **(kwargs or {}))
            if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
                return named.replace("torch.", "torch.cuda.", 1)
            return named

    return CudaTyped()


def _check_device(device):
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {device!r}")


def _scaler(cls, kwargs, device):
    with _on_device(device):
        scaler = cls(**kwargs)
    if scaler.scale.device.type != device:
        raise RuntimeError(f"megatron allocated its scale on {scaler.scale.device}, not {device}")
    return scaler


def read_back(scaler) -> dict:
    """The ``megatron`` (DynamicGradScaler) or ``megatron_constant`` profile's parameters as the scaler
    holds them; ``initial_scale`` is its current scale, so read it before the first update."""
    held = {"initial_scale": scaler.scale.item()}
    if hasattr(scaler, "growth_interval"):  # DynamicGradScaler; ConstantGradScaler keeps the scale alone
        held.update(min_scale=scaler.min_scale.item(), growth_factor=scaler.growth_factor.item(),
                    backoff_factor=scaler.backoff_factor.item(), growth_interval=scaler.growth_interval,
                    hysteresis=scaler.hysteresis)
    return held


def record_megatron(overflows, params, device):
    """DynamicGradScaler; its growth and hysteresis trackers are recorded as they are."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    _check_device(device)
    profile = get_profile("megatron")
    profile.rules(**params)  # a clear error for bad parameters before megatron's bare asserts
    kwargs = {**profile.defaults, **params}
    scaler = _scaler(DynamicGradScaler, kwargs, device)
    held = read_back(scaler)
    scales, counters, hysteresis = [], [], []
    for overflow in overflows:
        scales.append(scaler.scale.item())
        scaler.update(overflow)
        counters.append(scaler._growth_tracker)
        hysteresis.append(scaler._hysteresis_tracker)
    trace = observed_trace("megatron", params, overflows, scales, [not o for o in overflows], counters,
                           scaler.scale.item(), read_back=held)
    return dataclasses.replace(trace, hysteresis=hysteresis)


def record_megatron_constant(overflows, params, device):
    """ConstantGradScaler: update() does nothing; the count of consecutive overflowing steps
    (what fpemu's constant-scale traces record) comes from the flags, megatron keeps none."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler
    _check_device(device)
    profile = get_profile("megatron_constant")
    profile.rules(**params)
    scaler = _scaler(ConstantGradScaler, {**profile.defaults, **params}, device)
    held = read_back(scaler)
    scales, counters, streak = [], [], 0
    for overflow in overflows:
        scales.append(scaler.scale.item())
        scaler.update(overflow)
        streak = streak + 1 if overflow else 0
        counters.append(streak)
    return observed_trace("megatron_constant", params, overflows, scales, [not o for o in overflows], counters,
                          scaler.scale.item(), read_back=held)
