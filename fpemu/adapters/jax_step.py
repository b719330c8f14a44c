"""Seed 002's step written for jax.jit exactly as the seed describes, run on the CPU.

XLA reads ``XLA_FLAGS`` once, when its CPU backend starts, so one process computes in
one mode: ``"jax_cpu"`` (default flags: bf16 intermediates may stay in float32) or
``"jax_cpu_strict"`` (``--xla_allow_excess_precision=false``).  :func:`run_jax_steps`
runs in this process when its mode is the one asked for, and otherwise in a worker
subprocess started once with the other flags (JAX is imported there, not here).
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import subprocess
import sys

from fpemu.host import xla_cpu_tier
from fpemu.steps.semantics import XLA_CPU_TIERS

STRICT_FLAG = "--xla_allow_excess_precision=false"
MODES = ("jax_cpu", "jax_cpu_strict")


def process_mode() -> str:
    """The mode JAX computes in in this process (from XLA_FLAGS, which XLA parses at start-up)."""
    return "jax_cpu_strict" if STRICT_FLAG in os.environ.get("XLA_FLAGS", "").split() else "jax_cpu"


def host_semantics(mode: str) -> str:
    """The preset that models ``mode`` on this CPU, as this process's XLA computes it
    (:func:`xla_cpu_tier`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode + XLA_CPU_TIERS[xla_cpu_tier()][0]


@functools.lru_cache(maxsize=None)
def _jitted(compute: str):
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(compute)

    def loss_fn(params, x, y):
        w = params["w"].astype(dtype)
        b = params["b"].astype(dtype)
        y_hat = (x.astype(dtype) @ w + b).astype(jnp.float32)
        return jnp.mean((y_hat - y) ** 2)

    def train_step(params, x, y, loss_scale, good_steps, lr, growth_interval):
        def scaled(p):
            loss = loss_fn(p, x, y)
            return loss * loss_scale, loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        grads = jax.tree_util.tree_map(lambda g: g / loss_scale, grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
        updated = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        new_params = jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), updated, params)
        counted = good_steps + 1
        grow = counted >= growth_interval
        scale_ok = jnp.where(grow, loss_scale * 2.0, loss_scale)
        good_ok = jnp.where(grow, jnp.zeros_like(counted), counted)
        scale_bad = jnp.maximum(loss_scale * 0.5, jnp.float32(1.0))
        return {"loss": loss, "params": new_params,
                "loss_scale": jnp.where(finite, scale_ok, scale_bad).astype(jnp.float32),
                "good_steps": jnp.where(finite, good_ok, jnp.zeros_like(counted)).astype(jnp.int32),
                "grads_finite": finite}

    # growth_interval is traced, not static: one compiled program per shape serves every interval
    # (it only meets an integer compare, so the float computation is the same program).
    return jax.jit(train_step)


_JAX_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
               "fp32": "float32"}


def _run_here(cases, compute: str) -> list:
    import jax
    import numpy as np

    step = _jitted(_JAX_DTYPES[compute])
    cpu = jax.devices("cpu")[0]
    f32 = np.float32
    results = []
    for case in cases:
        args = jax.device_put(({"w": np.asarray(case["params"]["w"], f32), "b": np.asarray(case["params"]["b"], f32)},
                               np.asarray(case["x"], f32), np.asarray(case["y"], f32), f32(case["loss_scale"]),
                               np.int32(case["good_steps"]), f32(case["lr"]), np.int32(case["growth_interval"])), cpu)
        out = jax.device_get(step(*args))
        results.append({"loss": f32(out["loss"]),
                        "params": {"w": np.asarray(out["params"]["w"]), "b": np.asarray(out["params"]["b"])},
                        "loss_scale": f32(out["loss_scale"]), "good_steps": np.int32(out["good_steps"]),
                        "grads_finite": np.bool_(out["grads_finite"])})
    return results


class _Worker:
    """A subprocess computing with the other XLA flags; requests and replies are pickles."""

    def __init__(self, mode: str):
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_allow_excess_precision")]
        if mode == "jax_cpu_strict":
            flags.append(STRICT_FLAG)
        env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
        self.process = subprocess.Popen([sys.executable, "-m", "fpemu.adapters.jax_step"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = 0  # compile_later requests whose replies are still unread
        atexit.register(self.close)

    def _send(self, request, compute: str) -> None:
        pickle.dump((request, compute), self.process.stdin)
        self.process.stdin.flush()

    def _receive(self) -> list:
        status, payload = pickle.load(self.process.stdout)
        if status != "ok":
            raise RuntimeError(f"the JAX worker failed: {payload}")
        return payload

    def compile_later(self, shapes, compute: str) -> None:
        """Ask for the programs of these (B, D, K) shapes without waiting; the next run reads the
        (empty) reply.  Requests and replies stay a few bytes, far below a pipe's buffer."""
        self._send(("compile", tuple(shapes)), compute)
        self.pending += 1

    def run(self, cases, compute: str) -> list:
        self._send(list(cases), compute)
        for _ in range(self.pending):  # replies come back in request order
            self._receive()
        self.pending = 0
        return self._receive()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        self.process.stdout.close()


@functools.lru_cache(maxsize=None)
def _worker(mode: str) -> _Worker:
    return _Worker(mode)


def run_jax_steps(cases, *, mode: str = "jax_cpu", compute: str = "bf16") -> list:
    """Run the jitted step on each case on the CPU.

    Args:
      cases: dicts with the arguments of :func:`fpemu.steps.mixed_precision_step`
        (params, x, y, loss_scale, good_steps, lr, growth_interval).
      mode: ``"jax_cpu"`` (default XLA flags) or ``"jax_cpu_strict"``.
      compute: the compute format's fpemu name (``"bf16"``, ``"fp16"``, ...).

    Returns:
      One dict per case, shaped as mixed_precision_step's, with numpy values.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if compute not in _JAX_DTYPES:
        raise ValueError(f"compute must be one of {tuple(_JAX_DTYPES)}, got {compute!r}")
    if mode == process_mode():
        return _run_here(cases, compute)
    return _worker(mode).run(cases, compute)


def precompile(shapes, *, mode: str = "jax_cpu", compute: str = "bf16") -> None:
    """Have XLA compile the step for these (B, D, K) shapes without waiting for it: in the worker
    where ``mode`` is not this process's (on another core meanwhile), else nothing."""
    if mode != process_mode():
        _worker(mode).compile_later(shapes, compute)


def _compile_here(shapes, compute: str) -> None:
    import jax
    import numpy as np

    step = _jitted(_JAX_DTYPES[compute])
    f32, i32 = np.float32, np.int32
    for batch, dim, out in shapes:
        args = ({"w": np.zeros((dim, out), f32), "b": np.zeros(out, f32)}, np.zeros((batch, dim), f32),
                np.zeros((batch, out), f32), f32(1), i32(0), f32(1), i32(1))
        jax.block_until_ready(step(*jax.device_put(args, jax.devices("cpu")[0])))  # fills jit's cache


def jax_step(params, x, y, loss_scale, good_steps, lr, growth_interval, *, mode: str = "jax_cpu",
             compute: str = "bf16") -> dict:
    """One step under jax.jit (see :func:`run_jax_steps`)."""
    case = dict(params=params, x=x, y=y, loss_scale=loss_scale, good_steps=good_steps, lr=lr,
                growth_interval=growth_interval)
    return run_jax_steps([case], mode=mode, compute=compute)[0]


def step_function(compute: str, device: str, params: dict):
    """The adapter table's entry: the jitted step as a function of one step's arguments."""
    return lambda **case: jax_step(**case, mode=params["mode"], compute=compute)


def _serve() -> None:
    """Worker loop: read (cases, compute) pickles from stdin until it closes."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            cases, compute = pickle.load(stdin)
        except EOFError:
            return
        try:
            if isinstance(cases, tuple):  # ("compile", shapes) from compile_later
                reply = ("ok", _compile_here(cases[1], compute))
            else:
                reply = ("ok", _run_here(cases, compute))
        except Exception as error:  # reported to the caller, which raises
            reply = ("error", f"{type(error).__name__}: {error}")
        pickle.dump(reply, stdout)
        stdout.flush()


if __name__ == "__main__":
    _serve()
