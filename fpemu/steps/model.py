"""Forward and backward passes of dense models in a low-precision compute format.

A model is a list of dense layers ``(w, b)`` with float32 master weights and a
ReLU between layers; one layer is the seed's linear model.  The passes follow
the seed's program: cast the master weights and the input to the compute
format, matmul with float32 accumulation rounded once, add the bias, take the
float32 mean squared error, and differentiate ``S * loss`` back through every
cast.  Each rounding point is a :class:`~fpemu.steps.kernel.Kernel` call.
"""

from __future__ import annotations

import numpy as np

from fpemu.steps.kernel import F32, Kernel


def mse(k: Kernel, out: np.ndarray, y: np.ndarray):
    """The float32 mean squared error and the residual ``out - y``."""
    sub = k.sub(out, y)
    total = k.sum_of_squares(sub, rows=out.shape[0])
    n = sub.size
    if k.semantics.mean_by_reciprocal:
        return k.mul(total, F32(1.0 / n)), sub  # XLA: divide by a constant -> multiply by f32(1/n)
    return k.div(total, F32(n)), sub


def loss_cotangent(k: Kernel, sub: np.ndarray, scale) -> np.ndarray:
    """d(scale * mean(sub**2)) / d out in float32 (before the cast to the compute format)."""
    n = sub.size
    if not k.semantics.folded_cotangent:
        return k.mul(k.div(scale, F32(n)), k.mul(F32(2), sub))  # MeanBackward S/n, PowBackward 2*sub
    if n == 1:
        return k.mul(scale, k.mul(sub, F32(2)))  # XLA, no reduce: S * (sub * 2)
    return k.mul(sub, k.mul(scale, F32(2.0 / n)))  # XLA folds the constants: sub * f32(S * f32(2/n))


def forward_backward(k: Kernel, layers, x: np.ndarray, y: np.ndarray, scale):
    """The loss and the scaled gradients of a dense model.

    Args:
      k: the kernel (semantics and compute format).
      layers: ``[(w, b), ...]`` float32 master weights, w of shape (D_in, D_out).
      x, y: float32 input (B, D_in) and target (B, D_out of the last layer).
      scale: the float32 loss scale S.

    Returns:
      ``(loss, grads)``: the unscaled float32 loss and ``[(gw, gb), ...]``, the gradients of
      ``S * loss`` with respect to the master weights (compute-format values held in float32).
    """
    excess = k.semantics.excess_precision
    act = k.cast(x)
    saved = []
    last = len(layers) - 1
    for index, (w, b) in enumerate(layers):
        wc, bc = k.cast(w), k.cast(b)
        if k.semantics.fused_bias_add:  # ATen's addmm: bias added to the accumulator, one rounding
            pre = k.cast(k.add(k.dot(act, wc, "forward"), bc[None, :]))
        else:
            product = k.cast(k.dot(act, wc, "forward"))  # float32 accumulation, rounded once
            pre = k.add(product, bc[None, :])  # the bias add in float32 ...
            if not excess:
                pre = k.cast(pre)  # ... rounded to the compute format (XLA by default keeps float32)
        saved.append((act, wc, pre))
        act = pre if index == last else np.maximum(pre, F32(0))  # ReLU is exact
    loss, sub = mse(k, act, y)  # the output's cast to float32 is exact
    ct = k.cast(loss_cotangent(k, sub, scale))  # transpose of that cast: one rounding
    grads = []
    for index in range(last, -1, -1):
        act_in, wc, pre = saved[index]
        if index != last:
            ct = np.where(pre > 0, ct, F32(0))  # ReLU's backward is exact
        gb = k.batch_sum(ct)
        acc = k.dot(act_in.T, ct, "grad_w")
        # XLA with excess precision fuses a 1x1 weight's gradient with the unscale: no rounding.
        gw = acc if excess and acc.size == 1 else k.cast(acc)
        grads.append((gw, gb))
        if index:
            ct = k.cast(k.dot(ct, wc.T, "grad_x"))
    return loss, grads[::-1]


def sgd_update(k: Kernel, param: np.ndarray, grad: np.ndarray, lr) -> np.ndarray:
    """p - lr * g: one FMA when the semantics contracts it, else two roundings."""
    return k.mul_add(-lr, grad, param)


def unscale(k: Kernel, grad: np.ndarray, scale) -> np.ndarray:
    """grad / S, or grad * f32(1 / S) (GradScaler's reciprocal, computed in float64 then rounded)."""
    if k.semantics.unscale_by_reciprocal:
        return k.mul(grad, F32(1.0 / np.float64(scale)))
    return k.div(grad, scale)
