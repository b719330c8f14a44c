"""torch.amp.GradScaler and ShardedGradScaler, driven for real (CPU, or CUDA when present)."""

from __future__ import annotations

import os
import tempfile

from fpemu.adapters.observed import observed_trace
from fpemu.recorders.grad_scaler import grad_scaler_params


def _drive(scaler, torch, overflows, device):
    """One parameter whose scaled gradient is set to inf or 1.0 each step; the scaler decides
    whether optimizer.step runs, and a wrapper on that bound method counts the calls."""
    param = torch.nn.Parameter(torch.zeros((), device=device))
    optimizer = torch.optim.SGD([param], lr=1.0)
    calls = []
    real_step = optimizer.step
    optimizer.step = lambda *args, **kwargs: (calls.append(True), real_step(*args, **kwargs))[1]
    scales, applied, counters = [], [], []
    for overflow in overflows:
        scaler.scale(torch.ones((), device=device))  # lazily creates the scale on the first call
        scales.append(scaler._scale.item())
        param.grad = torch.full((), float("inf") if overflow else 1.0, device=device)
        before = len(calls)
        scaler.step(optimizer)
        scaler.update()
        applied.append(len(calls) > before)
        counters.append(int(scaler._growth_tracker.item()))
    return scales, applied, counters, scaler._scale.item()


def record_torch(overflows, params, device):
    import torch
    scaler = torch.amp.GradScaler(device, **params)
    return observed_trace("torch", params, overflows, *_drive(scaler, torch, overflows, device),
                          read_back=grad_scaler_params(scaler))


def _ensure_process_group(dist) -> None:
    if not dist.is_initialized():
        handle, path = tempfile.mkstemp(prefix="fpemu-gloo-")
        os.close(handle)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def record_torch_sharded(overflows, params, device):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    _ensure_process_group(dist)
    scaler = ShardedGradScaler(device, **params)
    return observed_trace("torch_sharded", params, overflows, *_drive(scaler, torch, overflows, device),
                          read_back=grad_scaler_params(scaler))
