"""A real accumulation loop for the recorder, audit and replay tests: a tiny Llama from a transformers config
(random weights, no download), fp16 autocast on CPU, torch.amp.GradScaler, AdamW, linear warmup, clipping, and
MICRO microbatches per update.  ``rule`` lets a real scaler of another framework (DeepSpeed's
DynamicLossScaler) decide each next scale, for reruns under another profile."""

import contextlib
import warnings

import torch

MICRO, BATCH, LENGTH, VOCAB = 4, 2, 8, 128


def llama(seed: int = 0):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def batches(steps: int, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator) for _ in range(MICRO)]
            for _ in range(steps)]


def training(model, steps: int, init_scale: float, growth_interval: int = 2000):
    import transformers
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    return optimizer, scheduler, scaler


def microbatch_backward(model, scaler, tokens) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(tokens, labels=tokens).loss / MICRO
    scaler.scale(loss).backward()


def train(model, optimizer, scheduler, scaler, data, *, rule=None, watch=None) -> list:
    """The user's loop; returns (scale, found inf) per update.  ``rule(found_inf) -> next scale`` replaces the
    GradScaler's own update rule; ``watch``: a context manager (a recorder or audit) around the loop."""
    seen = []
    with warnings.catch_warnings(), watch or contextlib.nullcontext():
        warnings.simplefilter("ignore")  # transformers' and the scheduler's warnings
        for step in data:
            optimizer.zero_grad()
            for tokens in step:
                microbatch_backward(model, scaler, tokens)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            found = any(float(v) for v in scaler._found_inf_per_device(optimizer).values())
            scaler.update(None if rule is None else rule(found))
            scheduler.step()
            seen.append((scale, found))
    return seen


class DeepSpeedRule:
    """DeepSpeed's own DynamicLossScaler deciding the next scale from each step's found-inf."""

    def __init__(self, **params):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
        self.scaler = DynamicLossScaler(**params)

    def __call__(self, found_inf: bool) -> float:
        self.scaler.update_scale(found_inf)
        return float(self.scaler.cur_scale)
