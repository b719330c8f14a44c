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


def mse(k: Kernel, out: np.ndarray, y: np.ndarray, inner: int):
    """The float32 mean squared error and the residual ``out - y`` (``inner``: the contraction
    length of the dot behind ``out``, which decides XLA's fp8 loss fusion)."""
    sub = k.sub(out, y)
    total = k.sum_of_squares(sub, rows=out.shape[0], inner=inner)
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


def dense_forward(k: Kernel, act: np.ndarray, w: np.ndarray, b: np.ndarray):
    """One dense layer's pre-activation ``act @ w + b`` in the compute format.

    Returns:
      ``(wc, pre)``: the compute-format weights (the input gradient needs them) and the
      pre-activation.
    """
    wc, bc = k.cast(w), k.cast(b)
    if k.fuses_fp16_bias_add(act.shape[1]):  # one f16 FMA, rounded once
        return wc, k.fma_result(act, wc, bc[None, :])
    if k.semantics.fused_bias_add:  # ATen's addmm: bias added to the accumulator, one rounding
        return wc, k.round_result(k.add(k.dot(act, wc, "forward"), bc[None, :]))
    product = k.round_result(k.dot(act, wc, "forward"))  # float32 accumulation, rounded once
    pre = k.add(product, bc[None, :])  # the bias add in float32 ...
    if k.excess_precision:
        return wc, pre  # ... kept in float32 (XLA's default excess precision)
    return wc, k.round_result(pre)  # ... rounded to the compute format


def _forward(k: Kernel, layers, x: np.ndarray):
    """The forward pass: what the backward reads of each layer, and the model's output.

    The backward reads a layer's compute-format w only for an input gradient (not layer 0's)
    and its pre-activation only for a ReLU mask (not the last layer's).  Keeping nothing else
    alive holds the step's peak memory near a plain float32 step's: above glibc's heap-trim
    threshold every step would hand its memory back and page-fault it in again.
    """
    act = k.cast(x)
    saved = []
    last = len(layers) - 1
    for index, (w, b) in enumerate(layers):
        wc, pre = dense_forward(k, act, w, b)
        saved.append((act, wc if index else None, pre if index != last else None))
        act = pre if index == last else np.maximum(pre, F32(0))  # ReLU is exact
    return saved, act


def _loss_and_cotangent(k: Kernel, out: np.ndarray, y: np.ndarray, scale, inner: int):
    """The float32 loss and the compute-format cotangent of ``S * loss`` at the output."""
    loss, sub = mse(k, out, y, inner)  # the output's cast to float32 is exact
    return loss, k.cast(loss_cotangent(k, sub, scale))  # transpose of that cast: one rounding


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
    if k.semantics.inductor_decompositions:
        if len(layers) != 1:
            raise ValueError("inductor_decompositions models the one-layer (linear) step only")
        (w, b), = layers
        loss, gw, gb = inductor_forward_backward(k, w, b, x, y, scale)
        return loss, [(gw, gb)]
    saved, out = _forward(k, layers, x)
    loss, ct = _loss_and_cotangent(k, out, y, scale, inner=layers[-1][0].shape[0])
    del out  # peak memory: see _forward
    grads = []
    for index in range(len(saved) - 1, -1, -1):
        act_in, wc, pre = saved[index]
        if pre is not None:
            ct = np.where(pre > 0, ct, F32(0))  # ReLU's backward is exact
        gb = k.batch_sum(ct)
        acc = k.dot(act_in.T, ct, "grad_w")
        # XLA with excess precision fuses a 1x1 weight's gradient with the unscale: no rounding.
        gw = acc if k.excess_precision and acc.size == 1 else k.round_result(acc)
        grads.append((gw, gb))
        if index:
            ct = k.round_result(k.dot(ct, wc.T, "grad_x"))
    return loss, grads[::-1]


def sgd_update(k: Kernel, param: np.ndarray, grad: np.ndarray, lr) -> np.ndarray:
    """p - lr * g: one FMA when the semantics contracts it, else two roundings."""
    return k.mul_add(-lr, grad, param)


def unscale(k: Kernel, grad: np.ndarray, scale) -> np.ndarray:
    """grad / S, or grad * f32(1 / S) (GradScaler's reciprocal, computed in float64 then rounded)."""
    if k.semantics.unscale_by_reciprocal:
        return k.mul(grad, F32(1.0 / np.float64(scale)))
    return k.div(grad, scale)


def _inductor_saves_bf16_operands(batch: int, dim: int, out: int) -> bool:
    """Whether torch 2.13's min-cut partitioner, for a Bx1xK step (K >= 2), saves the bf16
    casts of x, w, b (and y) for the backward instead of ``sub * 2`` and x_bf16.  Observed in
    the generated code for 4x1x4 only among B, D, K in 1..4 (4x1x2, 4x1x3, 3x1x4 save
    ``sub * 2``); a decision of the partitioner's cost model, not derived from it here."""
    return (batch, dim, out) == (4, 1, 4)


def inductor_forward_backward(k: Kernel, w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, scale):
    """The linear step as torch.compile (inductor, CPU, torch 2.13) generates it, per shape class.

    Read with ``TORCH_LOGS=output_code`` for every B, D, K in 1..4 (docs/steps.md).  With a
    dimension of 1, ``torch/_inductor/decomposition.py`` replaces ATen's ``addmm``/``mm`` by
    pointwise code (``(mat1.T * mat2).sum(0)``, ``sum(mat1 * mat2)``, the outer product
    ``self * input2``) under ``pw_cast_for_opmath``, and inductor's codegen maps
    ``to(float32)`` of a just-rounded bf16 value back to the float32 original (the
    ``convert<at::BFloat16>`` results are dead), so a value is rounded only where it goes
    through a bf16 *buffer*: an extern kernel's operand or result, or a kernel output.

    Returns:
      ``(loss, gw, gb)``: the float32 loss and the gradients of ``S * loss`` (bf16 values or,
      where inductor leaves them unrounded, float32 values).
    """
    batch, dim = x.shape
    out = w.shape[1]
    xc = k.cast(x)  # cpp_fused__to_copy: the bf16 x buffer saved for the backward

    # -- forward: pre = x @ w + b ------------------------------------------------------------
    if batch >= 2 and (dim >= 2 or out == 1):
        # extern_kernels.addmm(b_bf16, x_bf16, w_bf16): ATen's bf16 addmm, the bias added to
        # the float32 accumulator (products rounded, summed from +0) and rounded once.
        pre = k.round_result(k.add(k.dot(xc, k.cast(w), "forward"), k.cast(b)[None, :]))
    elif batch >= 2:
        # D == 1, K >= 2: mm's outer-product decomposition ``self * input2`` fused with the
        # bias add: ``tmp5 = V(x) * w; tmp9 = tmp5 + b``, the result unrounded.  x, w, b are
        # the float32 inputs, except where the partitioner saves their bf16 casts for the
        # backward (which then recomputes the prediction): the kernel stores them first and
        # reads the bf16 buffers (``tmp2 = loadu(out_ptr1 + x1)``).
        if _inductor_saves_bf16_operands(batch, dim, out):
            pre = k.add(k.mul(xc, k.cast(w)), k.cast(b)[None, :])
        else:
            pre = k.add(k.mul(x, w), b[None, :])
    elif out == 1 and dim >= 2:
        # 1 x D x 1: ``torch.sum(mat1.squeeze(0) * mat2.squeeze(-1))`` becomes a masked
        # 16-lane reduction of the float32 products x * w (x, w unrounded), then ``+ b``.
        pre = k.add(k.vector_sum(k.mul(x[0], w[:, 0])), b)[None, :]
    else:
        # B == 1, K >= 2 (and 1x1x1): ``(mat1.T * mat2).sum(0)`` unrolled over D from the first
        # product, ``* 1.0`` (alpha), ``+ b * 1.0`` (beta): w, b and the result stay float32.
        # x is the bf16 buffer when a separate cast loop stores it first (D >= 2, K >= 2:
        # ``tmp0 = out_ptr0[0]``); for D == 1 the fused kernel reads the float32 x (``V(tmp0)``).
        xs = xc if dim >= 2 and out >= 2 else x
        total = k.mul(xs[0, 0], w[0])
        for d in range(1, dim):
            total = k.add(total, k.mul(xs[0, d], w[d]))
        pre = k.add(total, b)[None, :]  # the multiplications by 1.0 are exact

    # -- loss and cotangent ----------------------------------------------------------------------
    if batch >= 2 and dim == 1 and out >= 2:
        # The loss is fused into the outer product's 2-d loop (rows outer, K in the vector
        # lanes): ``sum_masked_reduce(tmp_acc0_vec, tmp13, K)`` per row, so lane j sums column j.
        sub = k.sub(pre, y)
        loss = k.div(k.vector_sum(k.mul(sub, sub)), F32(sub.size))
    else:
        loss, sub = mse(k, pre, y, inner=dim)  # a flat vector_sum of sub * sub, then ``/ n``
    ct = loss_cotangent(k, sub, scale)  # ``((0 + 1 * S) / n) * (sub * 2)`` in float32
    ct_bf16 = k.cast(ct)  # stored to a bf16 buffer only where an extern mm or a row sum reads it

    # -- bias gradient: sum of the cotangent over the batch ----------------------------------
    if batch == 1:
        gb = ct[0]  # the sum over one row is the float32 cotangent itself (never rounded)
    elif out == 1:
        # K == 1: a full reduction: vector_sum of the float32 cotangent, stored to a bf16
        # buffer (``out_ptr1[0] = static_cast<at::BFloat16>(tmp_acc0)``): rounded once.
        gb = k.round_result(k.vector_sum(ct[:, 0])).reshape(1)
    else:
        # K >= 2: unrolled pointwise sum of the bf16 cotangent rows from row 0, the result's
        # convert to bf16 elided: float32.
        gb = k.batch_sum(ct_bf16)

    # -- weight gradient: x_bf16.T @ ct ----------------------------------------------------------
    if batch == 1 and (dim >= 2) == (out >= 2):
        # 1xDxK (D, K >= 2) and 1x1x1: the outer product x_bf16[d] * ct[k] with the float32
        # cotangent, unrounded (``tmp14 = V(x) * tmp11; tmp15 = convert<BFloat16>(tmp14)`` dead).
        gw = k.mul(xc.T, ct)
    elif batch >= 2 and dim == 1 and out == 1:
        # Bx1x1: ``sum(mat1 * mat2)`` as a vector_sum of ct_f32 * x_bf16 over the batch,
        # stored as float32 (its bf16 convert is dead).
        gw = k.vector_sum(k.mul(ct[:, 0], xc[:, 0])).reshape(1, 1)
    elif batch == 1:
        # 1xDx1 and 1x1xK: extern_kernels.mm(permute(x_bf16), ct_bf16) with a contraction of 1
        # and an output dimension of 1: ATen rounds the product, then adds it to +0 (probed with
        # torch.mm(a.t(), b): an underflowing product gives +0, not the fused chain's -0).
        gw = k.round_result(k.add(F32(0), k.mul(xc.T, ct_bf16)))
    else:
        # extern_kernels.mm(permute(x_bf16), ct_bf16): ATen's bf16 mm, rounded once, as eager.
        gw = k.round_result(k.dot(xc.T, ct_bf16, "grad_w"))
    return loss, gw, gb
