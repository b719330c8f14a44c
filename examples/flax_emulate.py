"""A small flax.linen causal language model computing in fp16 (float32 parameters, Adam) for
``fpemu emulate``, which evaluates its jaxpr primitive by primitive with every fp16 result rounded
by fpemu's kernel:

    fpemu emulate examples/flax_emulate.py --steps 24 --scaler flax \\
        --param scale=1048576 --param growth_interval=4 --out reports/emulate

The model-file contract for JAX (``fpemu emulate --help``): the file declares ``FRAMEWORK = "jax"``;
``build(seed)`` returns the training state; ``grads(state, scale, index)`` returns the loss and the
gradients of ``scale * loss``; ``update(state, grads, index)`` applies the unscaled gradients.  The
scaler is the loop's (fpemu's model of the profile), as flax's DynamicScale would be around a jitted
step.  The model is examples/flax_loop.py's TinyLM, smaller.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flax_loop import Config, TinyLM  # noqa: E402  (the flax example's model)

FRAMEWORK = "jax"
CONFIG = Config(vocab=128, width=32, heads=2, layers=2, context=16)
BATCH, BATCHES = 4, 8
MODEL = TinyLM(CONFIG)  # dtype float16: activations and their gradients in fp16, parameters float32
OPTIMIZER = optax.adam(3e-3)
# Token ids with a learnable pattern (each sequence counts up from a random start), one batch per step.
_STARTS = np.random.default_rng(1).integers(0, CONFIG.vocab, (BATCHES, BATCH, 1))
DATA = jnp.asarray((_STARTS + np.arange(CONFIG.context + 1)) % CONFIG.vocab, jnp.int32)


def build(seed: int):
    params = MODEL.init(jax.random.PRNGKey(seed), jnp.zeros((1, CONFIG.context), jnp.int32))["params"]
    return {"params": params, "opt": OPTIMIZER.init(params)}


def _loss(params, tokens):
    logits = MODEL.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def grads(state, scale, index):
    tokens = DATA[index % BATCHES]
    scaled = lambda p: (lambda loss: (loss * scale, loss))(_loss(p, tokens))  # noqa: E731
    gradients, loss = jax.grad(scaled, has_aux=True)(state["params"])
    return loss, gradients


def update(state, gradients, index):
    updates, opt = OPTIMIZER.update(gradients, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}
