"""Seed 002's step in torch: eager on the CPU (or CUDA, same code), optionally torch.compile'd."""

from __future__ import annotations

import functools

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                 "fp32": "float32"}


def _gradients(w, b, x, y, scale, dtype):
    """Forward in the compute dtype, float32 MSE, backward of scale * loss to the float32 leaves."""
    import torch
    with torch.enable_grad():
        w = w.detach().requires_grad_(True)
        b = b.detach().requires_grad_(True)
        y_hat = (x.to(dtype) @ w.to(dtype) + b.to(dtype)).float()
        loss = ((y_hat - y) ** 2).mean()
        grad_w, grad_b = torch.autograd.grad(loss * scale, (w, b))
    return loss.detach(), grad_w, grad_b


@functools.lru_cache(maxsize=None)
def _compiled():
    import torch
    return torch.compile(_gradients, dynamic=False)


def torch_step(params, x, y, loss_scale, good_steps, lr, growth_interval, *, compute: str = "bf16",
               device: str = "cpu", unscale: str = "divide", compiled: bool = False) -> dict:
    """One step in torch, returned as numpy values shaped as mixed_precision_step's.

    Args:
      compute: the compute format's fpemu name.
      device: ``"cpu"`` or ``"cuda"``.
      unscale: ``"divide"`` (``grad / S``, the seed) or ``"reciprocal"`` (``grad * (1/S)``
        with the reciprocal computed in float64 and rounded, as torch.amp.GradScaler does).
      compiled: run the forward and backward through torch.compile (inductor).
    """
    import numpy as np
    import torch

    if compute not in _TORCH_DTYPES:
        raise ValueError(f"compute must be one of {tuple(_TORCH_DTYPES)}, got {compute!r}")
    if unscale not in ("divide", "reciprocal"):
        raise ValueError(f"unscale must be 'divide' or 'reciprocal', got {unscale!r}")
    dtype = getattr(torch, _TORCH_DTYPES[compute])

    def tensor(value):
        return torch.as_tensor(np.asarray(value, np.float32), device=device)

    w, b, x, y = tensor(params["w"]), tensor(params["b"]), tensor(x), tensor(y)
    scale, lr = tensor(loss_scale), tensor(lr)
    loss, grad_w, grad_b = (_compiled() if compiled else _gradients)(w, b, x, y, scale, dtype)
    with torch.no_grad():
        if unscale == "divide":
            grad_w, grad_b = grad_w / scale, grad_b / scale
        else:
            inverse = scale.double().reciprocal().float()
            grad_w, grad_b = grad_w * inverse, grad_b * inverse
        finite = bool(torch.isfinite(grad_w).all() and torch.isfinite(grad_b).all())
        if finite:
            w, b = w - lr * grad_w, b - lr * grad_b
            counted = good_steps + 1
            grow = counted >= growth_interval
            new_scale, new_good = (scale * 2, 0) if grow else (scale, counted)
        else:
            new_scale, new_good = torch.maximum(scale * 0.5, torch.ones_like(scale)), 0
    f32 = np.float32
    return {"loss": f32(loss.cpu().numpy()), "params": {"w": w.cpu().numpy(), "b": b.cpu().numpy()},
            "loss_scale": f32(new_scale.cpu().numpy()), "good_steps": np.int32(new_good),
            "grads_finite": np.bool_(finite)}


def step_function(compute: str, device: str, params: dict):
    """The adapter table's entry: the eager step as a function of one step's arguments."""
    return lambda **case: torch_step(**case, compute=compute, device=device, unscale=params["unscale"])


def compiled_step_function(compute: str, device: str, params: dict):
    """The adapter table's entry for torch.compile: the same step with its forward and backward
    compiled by inductor (what a torch.compile'd training step computes)."""
    return lambda **case: torch_step(**case, compute=compute, device=device, unscale=params["unscale"],
                                     compiled=True)
