"""The programs emulate_jax is checked on against jax.jit (tests/test_emulate_jax.py,
benchmarks/jax_emulate_ops.py).

Each case is (function, number of arguments); arguments are 1024-element arrays (4096 in the report)
of the format (reshaped by the function where it needs a matrix).  ``SINGLE`` are one-primitive
programs (besides free reshapes): with their inputs and result in the low format there is no
intermediate XLA could keep in float32.  ``COMPOSITE`` chain primitives (where XLA's fusion may skip
roundings the program asks for).
"""

import jax
import jax.numpy as jnp
import numpy as np

SINGLE = {
    "add": (lambda a, b: a + b, 2), "sub": (lambda a, b: a - b, 2), "mul": (lambda a, b: a * b, 2),
    "div": (lambda a, b: a / b, 2), "max": (jnp.maximum, 2), "neg": (lambda a: -a, 1),
    "square": (jnp.square, 1), "integer_pow 2": (lambda a: a ** 2, 1), "integer_pow 3": (lambda a: a ** 3, 1),
    "exp": (jnp.exp, 1), "log (of |x|)": (lambda a: jnp.log(jnp.abs(a)), 1), "tanh": (jnp.tanh, 1),
    "logistic": (jax.nn.sigmoid, 1), "sqrt (of |x|)": (lambda a: jnp.sqrt(jnp.abs(a)), 1),
    "rsqrt (of |x|)": (lambda a: jax.lax.rsqrt(jnp.abs(a)), 1), "erf": (jax.scipy.special.erf, 1),
    "sin": (jnp.sin, 1), "log1p (of |x|)": (lambda a: jnp.log1p(jnp.abs(a)), 1), "expm1": (jnp.expm1, 1),
    "reduce_sum over rows": (lambda a: jax.lax.reduce_sum_p.bind(a.reshape(16, -1), axes=(1,), out_sharding=None), 1),
    "dot_general (16, n/16) @ (n/16, 16)": (lambda a, b: a.reshape(16, -1) @ b.reshape(-1, 16), 2),
    "cumsum over rows": (lambda a: jnp.cumsum(a.reshape(16, -1), -1), 1),
    "convert to float8_e4m3fn": (lambda a: a.astype(jnp.float8_e4m3fn), 1),
    "convert to float8_e5m2": (lambda a: a.astype(jnp.float8_e5m2), 1),
}
COMPOSITE = {
    "float32 multiply, rounded": (lambda a, b: (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(a.dtype), 2),
    "a * b + a": (lambda a, b: a * b + a, 2),
    "gelu (tanh)": (jax.nn.gelu, 1), "gelu (erf)": (lambda a: jax.nn.gelu(a, approximate=False), 1),
    "softmax over rows": (lambda a: jax.nn.softmax(a.reshape(16, -1)), 1),
    "jnp.sum over rows": (lambda a: a.reshape(16, -1).sum(-1), 1),
    "jnp.mean over rows": (lambda a: a.reshape(16, -1).mean(-1), 1),
    "layer norm over rows": (lambda a: jax.nn.standardize(a.reshape(16, -1), axis=-1), 1),
}

# The excess-precision rule one reader at a time (docs/emulate.md): a result XLA computes in float32 read by
# an upcast the program states (kept in float32 under default flags), through a reshape (rounded), a dot's
# result upcast (kept), erfc's input (kept: JAX lowers erfc with an upcast) and result (rounded), a 1x1
# transpose (deleted by XLA: kept), a value read both upcast and as an output (kept for the upcast only), the
# last multiply of integer_pow and the last divide of logistic (kept),
# across a jit call either way (XLA inlines it: kept).
EXCESS = {
    "a * b upcast": (lambda a, b: (a * b).astype(jnp.float32), 2),
    "a * b reshaped, upcast": (lambda a, b: (a * b).reshape(16, -1).astype(jnp.float32), 2),
    "dot upcast": (lambda a, b: (a.reshape(16, -1) @ b.reshape(-1, 16)).astype(jnp.float32), 2),
    "erfc of a * b, upcast": (lambda a, b: jax.lax.erfc(a * b * 0.1).astype(jnp.float32), 2),
    "a * b, 1x1 transpose, upcast": (lambda a, b: (a.reshape(-1, 1)[8:9] * b.reshape(-1, 1)[8:9]).T.astype(jnp.float32),
                                     2),
    "a * b upcast and returned": (lambda a, b: (a * b).astype(jnp.float32) + (a * b), 2),
    "a ** 3 and sigmoid, upcast": (lambda a, b: (a ** 3).astype(jnp.float32) + jax.nn.sigmoid(b).astype(jnp.float32), 2),
    "a * b upcast in a jit": (lambda a, b: jax.jit(lambda v: v.astype(jnp.float32))(a * b), 2),
    "a jit's a * b upcast": (lambda a, b: jax.jit(jnp.multiply)(a, b).astype(jnp.float32), 2),
}


def inputs(dtype, count: int, seed: int, size: int = 1024) -> list:
    """``count`` arrays of ``dtype``: normal values at three magnitudes, the first eight special
    (signed zeros, infinities, NaN, float32 subnormals, fp16's smallest subnormal)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        values = (rng.standard_normal(size) * rng.choice([1e-3, 1.0, 30.0], size)).astype(np.float32)
        values[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 6e-8]
        out.append(values.astype(dtype))
    return out
