"""A real JAX transformer training loop: a small flax.linen causal language model computing in fp16
(float32 parameters), AdamW with warmup and cosine decay, gradient clipping, and flax's DynamicScale.

``train_step`` is the user's jitted step; the only lines fpemu adds are ``recorder.grad_stats(...)``
inside it (a small pytree of counts and maxima comes out as aux, no gradient leaves the step) and
``recorder.record(...)`` after it.  Run ``python examples/flax_loop.py --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training.dynamic_scale import DynamicScale


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    width: int = 64
    heads: int = 4
    layers: int = 2
    context: int = 32


class Block(nn.Module):
    width: int
    heads: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(
            nn.LayerNorm(dtype=self.dtype)(x), mask=mask)
        h = nn.Dense(4 * self.width, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(self.width, dtype=self.dtype)(nn.gelu(h))


class TinyLM(nn.Module):
    config: Config
    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        positions = self.param("positions", nn.initializers.normal(0.02), (c.context, c.width))
        x = nn.Embed(c.vocab, c.width, dtype=self.dtype)(tokens) + positions[:tokens.shape[1]].astype(self.dtype)
        for _ in range(c.layers):
            x = Block(c.width, c.heads, self.dtype)(x)
        return nn.Dense(c.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def batches(config: Config, steps: int, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, config.vocab, (batch, config.context + 1)), jnp.int32) for _ in range(steps)]


def schedule_count(opt_state):
    """The count of the learning-rate schedule in an optax state (the one optax.adamw(schedule) keeps)."""
    is_schedule = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
    return next(s.count for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_schedule) if is_schedule(s))


def make_step(model, optimizer, schedule, recorder):
    """The user's jitted train step, with fpemu's one line inside."""

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, dynamic_scale, tokens):
        new_scale, is_fin, loss, grads = dynamic_scale.value_and_grad(loss_fn)(params, tokens)  # grads unscaled
        stats = recorder.grad_stats(grads, scale=dynamic_scale.scale)  # fpemu: as the fp16 backward held them
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        # a skipped step keeps its optimizer state too, so the schedule moves only with updates
        params, opt_state = jax.tree_util.tree_map(lambda new, old: jnp.where(is_fin, new, old),
                                                   (optax.apply_updates(params, updates), new_opt_state),
                                                   (params, opt_state))
        aux = {"stats": stats, "loss": loss, "is_fin": is_fin, "grad_norm": optax.global_norm(grads),
               "lr": schedule(schedule_count(opt_state) - 1), "count": schedule_count(opt_state)}
        return params, opt_state, new_scale, aux

    return train_step


def make_shadow(config, recorder):
    """A jitted float32 pass over the same batch beside the fp16 one: the true underflow (fpemu's
    shadow statistics).  It costs one fp16 and one float32 forward and backward, on sampled steps."""
    fp16, fp32 = TinyLM(config), TinyLM(config, dtype=jnp.float32)

    def loss(model, params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

    @jax.jit
    def shadow(params, scale, tokens):
        run = jax.grad(lambda p: loss(fp16, p, tokens) * scale)(params)  # as the step's backward scales it
        return recorder.shadow_stats(run, jax.grad(lambda p: loss(fp32, p, tokens))(params))

    return shadow


def record(path=None, *, steps=30, batch=8, init_scale=2.0 ** 16, growth_interval=2000, lr=3e-3, warmup=5,
           config=Config(), group_by="module", name="flax_lm_fp16", seed=0, shadow_every=0):
    """Train the model under ``fpemu.record_jax`` and return the recorder (its trace is written to ``path``)."""
    import fpemu
    model = TinyLM(config)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, config.context), jnp.int32))["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    opt_state = optimizer.init(params)
    dynamic_scale = DynamicScale(growth_interval=growth_interval, scale=jnp.float32(init_scale))
    recorder = fpemu.record_jax("fp16", name=name, scaler="flax", group_by=group_by, batch_size=batch, path=path,
                                params={"scale": init_scale, "growth_interval": growth_interval,
                                        "growth_factor": 2.0, "backoff_factor": 0.5}, shadow_every=shadow_every)
    train_step = make_step(model, optimizer, schedule, recorder)
    shadow = make_shadow(config, recorder) if shadow_every else None
    with recorder:
        for index, tokens in enumerate(batches(config, steps, batch)):
            sampled = shadow is not None and index % shadow_every == 0
            shadow_stats = shadow(params, dynamic_scale.scale, tokens) if sampled else None  # before the update
            params, opt_state, new_scale, aux = train_step(params, opt_state, dynamic_scale, tokens)
            # applied: the step selects the update on is_fin (the warmup's lr of 0 leaves the parameters as they
            # were, so comparing them would read its first update as skipped)
            recorder.record(aux["stats"], scale_state=dynamic_scale, next_scale_state=new_scale, loss=aux["loss"],
                            grad_norm=aux["grad_norm"], lr=aux["lr"], overflow=~aux["is_fin"], applied=aux["is_fin"],
                            schedule_count=aux["count"], shadow=shadow_stats)
            dynamic_scale = new_scale
    return recorder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="where to write the recorded trace (JSON)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--init-scale", type=float, default=2.0 ** 16)
    parser.add_argument("--growth-interval", type=int, default=2000)
    parser.add_argument("--group-by", choices=("module", "parameter"), default="module")
    parser.add_argument("--shadow-every", type=int, default=0, help="a float32 shadow pass every N steps (0: none)")
    parser.add_argument("--name", default="flax_lm_fp16")
    args = parser.parse_args(argv)
    recorder = record(args.path, steps=args.steps, init_scale=args.init_scale, growth_interval=args.growth_interval,
                      group_by=args.group_by, name=args.name, shadow_every=args.shadow_every)
    with contextlib.suppress(BrokenPipeError):
        summary = recorder.trace().summary
        print(f"{args.path}: {summary['attempts']} attempts, {summary['skipped_updates']} skipped, "
              f"final scale {summary['final_scale']:g}")


if __name__ == "__main__":
    main()
