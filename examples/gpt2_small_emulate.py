"""GPT-2 small (124M parameters: transformers' GPT2LMHeadModel from the default GPT2Config, random
weights, no download), batch 4 x 128, for ``fpemu emulate``:

    fpemu emulate examples/gpt2_small_emulate.py --policy cuda_autocast_fp16 --steps 1 --scaler torch \\
        --out reports/local/gpt2_small

The same model-file contract as examples/gpt2_emulate.py (``build(seed)``, ``step(...)``).  Measured
(torch 2.13.0+cpu, transformers 5.24, one emulated step with the full telemetry, on the shared 2-core
machine under load): exit 0, peak resident memory 3.41 GB (``/usr/bin/time -v``), 2 min 35 s wall,
43 s user CPU.  The plain step's time beside it was not measured.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, CONTEXT = 4, 128


def build(seed: int):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # 12 x 768, vocab 50257
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def batch(index: int) -> torch.Tensor:
    return torch.randint(0, 50257, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(index))


def step(model, optimizer, scaler, index: int):
    ids = batch(index)
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
