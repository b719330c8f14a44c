"""The team's torch loop: an MLP under CPU autocast (fp16) with GradScaler, 4 microbatches of gradient
accumulation and gradient clipping, recorded by ``fpemu.record_torch`` (the loop itself is unchanged)."""

from __future__ import annotations

import torch

MICROBATCHES = 4


def data(steps: int, seed: int = 1):
    """(inputs, targets) per step and microbatch, fixed by the seed; the targets are large enough that the
    first steps overflow fp16 at the initial scale."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, MICROBATCHES, 8, 16, generator=generator)
    y = 4.0 * torch.randn(steps, MICROBATCHES, 8, 4, generator=generator)
    return x, y


def train(steps: int = 12, init_scale: float = 2.0 ** 20, growth_interval: int = 3, reverse_microbatches: bool = False,
          path=None):
    """Train and return the recorded trace.  ``reverse_microbatches`` accumulates the microbatches in the
    other order: the same trajectory, other float32 rounding (a harmless change, as a kernel upgrade is)."""
    import fpemu
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    x, y = data(steps)
    order = list(range(MICROBATCHES))[::-1] if reverse_microbatches else list(range(MICROBATCHES))
    with fpemu.record_torch(scaler, optimizer, model, name="torch_loop", path=path) as recorder:
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            for micro in order:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x[step, micro]), y[step, micro]) / MICROBATCHES
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    return recorder.trace
