"""A GPT-2 (transformers' GPT2LMHeadModel, random weights from a GPT2Config: no download) for
``fpemu emulate``:

    fpemu emulate examples/gpt2_emulate.py --policy cuda_autocast_fp16 --steps 40 --scaler torch \\
        --param init_scale=1048576 --param growth_interval=8 --out reports/emulate

The model-file contract (``fpemu emulate --help``): ``build(seed)`` returns ``(model, optimizer)``;
``step(model, optimizer, scaler, index)`` runs training step ``index`` with the torch.amp.GradScaler
interface and returns the loss.  This is an ordinary CUDA mixed-precision loop with the autocast
context left out: the policy places the ops.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

LAYERS, WIDTH, HEADS, VOCAB, CONTEXT, BATCH = 4, 256, 4, 1024, 64, 8


def build(seed: int):
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=CONTEXT,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def batch(index: int) -> torch.Tensor:
    """Token ids with a learnable pattern (each sequence counts up from a random start)."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=torch.Generator().manual_seed(index))
    return (start + torch.arange(CONTEXT)) % VOCAB


def step(model, optimizer, scaler, index: int):
    ids = batch(index)
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
