"""A tiny torch MLP (16 -> 32 -> 1, SGD, fp16) for the one-command answers of docs/questions.md.

As a model file for ``fpemu emulate`` (``build(seed)`` -> ``(model, optimizer)``; ``step(model, optimizer,
scaler, index)`` -> the loss, with the GradScaler interface and no autocast: the policy places the ops):

    fpemu emulate examples/tiny_mlp.py --steps 6 --out reports/local/questions/emulate

As a script: the same loop under CPU fp16 autocast with a torch.amp.GradScaler and gradient clipping,
recorded by ``fpemu.record_torch``; ``--clip-before-unscale`` makes the classic mistake (clipping the
still-scaled gradients), which the recording's audit reports:

    python examples/tiny_mlp.py reports/local/questions/good.json
"""

import argparse

import torch

STEPS, BATCH, CLIP = 8, 64, 1.0


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(index: int):
    """Inputs and a target the model can learn (half the first input)."""
    x = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(index))
    return x, 0.5 * x[:, :1]


def step(model, optimizer, scaler, index: int):
    x, y = batch(index)
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def record(path, steps: int = STEPS, init_scale: float = 2.0 ** 16, clip_before_unscale: bool = False):
    """The loop, recorded to ``path``; returns the recorder (``rec.audit`` holds the audit's findings)."""
    import fpemu
    model, optimizer = build(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with fpemu.record_torch(scaler, optimizer, model, batch_size=BATCH, path=path, name="tiny_mlp") as rec:
        for index in range(steps):
            x, y = batch(index)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if not clip_before_unscale:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(optimizer)
            scaler.update()
    return rec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="where to write the recorded trace (JSON)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--init-scale", type=float, default=2.0 ** 16)
    parser.add_argument("--clip-before-unscale", action="store_true", help="clip the still-scaled gradients")
    args = parser.parse_args(argv)
    rec = record(args.path, args.steps, args.init_scale, args.clip_before_unscale)
    summary = rec.trace.summary
    print(f"wrote {args.path}: {summary['attempts']} attempts, {summary['skipped_updates']} skipped, "
          f"final scale {summary['final_scale']:g}")
    print(rec.audit.summary())


if __name__ == "__main__":
    main()
