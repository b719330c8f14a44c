"""A real transformer training loop: GPT-2 from a transformers config (random weights, no download),
AdamW, linear warmup, gradient clipping, fp16 autocast on CPU and a GradScaler.

``train(model, ...)`` is the user's loop, unchanged whether or not fpemu watches it; ``record`` runs it
under ``fpemu.record_torch`` and writes the trace.  Run ``python examples/gpt2_loop.py --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch


def make_model(layers: int = 4, width: int = 64, heads: int = 4, vocab: int = 1024, context: int = 64, seed: int = 0):
    """A GPT-2 language model with random weights; dropout off so a float32 shadow pass sees the same network."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=context,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def batches(steps: int, batch: int, length: int, vocab: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, length), generator=generator) for _ in range(steps)]


def make_training(model, *, lr=1e-3, warmup=5, steps=40, init_scale=2.0 ** 16, growth_interval=2000):
    """(optimizer, scheduler, scaler) as a user would set them up."""
    import transformers
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    return optimizer, scheduler, scaler


def train(model, optimizer, scheduler, scaler, data, *, clip=1.0, recorder=None):
    """The user's loop.  ``recorder``: a TorchRecorder whose float32 shadow pass runs after the backward."""
    for tokens in data:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(tokens, labels=tokens).loss
        scaler.scale(loss).backward()
        if recorder is not None:
            recorder.shadow(lambda: model(tokens, labels=tokens).loss)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()


def record(path, *, steps=40, batch=8, length=32, shadow_every=10, init_scale=2.0 ** 16, growth_interval=2000,
           layers=4, width=64, statistics=True, name="gpt2_fp16"):
    """Train the GPT-2 under fpemu.record_torch and return the recorder (its trace is written to ``path``)."""
    import fpemu
    model = make_model(layers=layers, width=width)
    optimizer, scheduler, scaler = make_training(model, steps=steps, init_scale=init_scale,
                                                 growth_interval=growth_interval)
    data = batches(steps, batch, length, model.config.vocab_size)
    with warnings.catch_warnings(), fpemu.record_torch(
            scaler, optimizer, model, scheduler, shadow_every=shadow_every, batch_size=batch, path=path,
            name=name, statistics=statistics) as rec:
        warnings.simplefilter("ignore")
        train(model, optimizer, scheduler, scaler, data, recorder=rec)
    return rec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="where to write the recorded trace (JSON)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--init-scale", type=float, default=2.0 ** 16)
    parser.add_argument("--growth-interval", type=int, default=2000)
    parser.add_argument("--shadow-every", type=int, default=10)
    parser.add_argument("--name", default="gpt2_fp16")
    args = parser.parse_args(argv)
    rec = record(args.path, steps=args.steps, init_scale=args.init_scale, growth_interval=args.growth_interval,
                 shadow_every=args.shadow_every, name=args.name)
    with contextlib.suppress(BrokenPipeError):
        summary = rec.trace.summary
        print(f"{args.path}: {summary['attempts']} attempts, {summary['skipped_updates']} skipped, "
              f"final scale {summary['final_scale']:g}")
        print(rec.audit.summary())


if __name__ == "__main__":
    main()
