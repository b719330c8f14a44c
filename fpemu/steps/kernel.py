"""The arithmetic of a step: float32 ops with optional FTZ/DAZ, FMA, casts, dots and sums.

:class:`Kernel` binds a :class:`StepSemantics` to a compute format.  Every float32
operation of the emulated step goes through it, so every rounding point is one
call: ``add``/``sub``/``mul``/``div``/``fma`` round once to float32, ``cast``
rounds once to the compute format, and ``dot``/``total``/``batch_sum`` fix the
accumulation order.

Without FTZ, + - * / are numpy's float32 ops (IEEE, correctly rounded).  With FTZ
they are evaluated in float64 and rounded once to float32, which is correctly
rounded for float32 operands (53 >= 2 * 24 + 2 bits) and lets the flush see the
unbounded-exponent result.  An FMA computes the float64 sum in round-to-odd
first, which makes its second rounding correct too.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fpemu.formats import Format, get_format, quantize
from fpemu.steps.semantics import StepSemantics

F32 = np.float32
_TINY = F32(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
_NO_FLAGS = dict(all="ignore")
_FP16 = get_format("fp16")


def _odd_sum(product: np.ndarray, addend: np.ndarray) -> np.ndarray:
    """product + addend in float64 rounded to odd (so a later rounding to float32 is exact).

    The float64 sum is rounded to nearest; its exact error comes from TwoSum.  Where it
    is not zero, the sum is truncated toward zero and its last bit set.
    """
    total = product + addend
    back = total - addend
    error = (product - back) + (addend - (total - back))
    inexact = np.isfinite(total) & (error != 0)
    truncated = np.where(inexact & (np.sign(error) != np.sign(total)), np.nextafter(total, 0.0), total)
    odd = (truncated.view(np.uint64) | np.uint64(1)).view(np.float64)
    return np.where(inexact, odd, total)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """float32 arithmetic and compute-format casts under one semantics.

    Args:
      semantics: the implementation's rounding behaviour.
      fmt: the compute format (``fp32`` makes every cast exact).
    """

    semantics: StepSemantics
    fmt: Format

    # -- float32 arithmetic ------------------------------------------------
    def _operand(self, a) -> np.ndarray:
        """a as float64; with DAZ, float32 subnormals read as signed zero."""
        a = np.asarray(a, F32)
        if self.semantics.flush_subnormals:
            a = np.where(np.abs(a) < _TINY, np.copysign(F32(0), a), a)
        return a.astype(np.float64)

    def _round(self, exact: np.ndarray) -> np.ndarray:
        """Round float64 values to float32 (nearest even); with FTZ, results that are tiny
        *after* rounding (x86 detects tininess after rounding) become signed zero."""
        with np.errstate(**_NO_FLAGS):
            rounded = exact.astype(F32)
        if not self.semantics.flush_subnormals:
            return rounded
        small = np.abs(rounded) < _TINY
        if not np.any(small):
            return rounded
        with np.errstate(**_NO_FLAGS):
            # Rounded with an unbounded exponent range (scaled by 2**64): reaches 2**-62 exactly
            # when the value rounds up to the smallest normal, which x86 then keeps.
            unbounded = (exact * 2.0 ** 64).astype(F32)
        keeps_tiny = small & (np.abs(unbounded) >= F32(2.0 ** -62))
        flushed = np.where(keeps_tiny, np.copysign(_TINY, exact).astype(F32), np.copysign(F32(0), exact).astype(F32))
        return np.where(small, flushed, rounded).astype(F32)

    def _binary(self, op, a, b):
        """op(a, b) rounded once to float32.  Without FTZ numpy's float32 op is already IEEE
        (correctly rounded, gradual underflow); with FTZ it is evaluated in float64 first."""
        with np.errstate(**_NO_FLAGS):
            if not self.semantics.flush_subnormals:
                return op(np.asarray(a, F32), np.asarray(b, F32))
            return self._round(op(self._operand(a), self._operand(b)))

    def add(self, a, b):
        return self._binary(np.add, a, b)

    def sub(self, a, b):
        return self._binary(np.subtract, a, b)

    def mul(self, a, b):
        return self._binary(np.multiply, a, b)

    def div(self, a, b):
        return self._binary(np.divide, a, b)

    def fma(self, a, b, c):
        """a * b + c with one rounding (the product of two float32 values is exact in float64)."""
        with np.errstate(**_NO_FLAGS):
            return self._round(_odd_sum(self._operand(a) * self._operand(b), self._operand(c)))

    def mul_add(self, a, b, c):
        """a * b + c as the semantics evaluates it: one FMA, or a rounded product then a rounded sum."""
        return self.fma(a, b, c) if self.semantics.fma else self.add(self.mul(a, b), c)

    # -- the compute format ------------------------------------------------
    def cast(self, a) -> np.ndarray:
        """float32 -> compute format -> float32: one rounding to nearest even, never through
        float64 (ml_dtypes rounds float64 -> bf16 twice).  The widening back is exact."""
        a = np.asarray(a, F32)
        if self.fmt.name == "fp32":
            return a
        return quantize(a, self.fmt)

    def round_result(self, a) -> np.ndarray:
        """The result of a compute-format op (a dot, an add, a reduction step), held exactly or in
        float32, rounded to the compute format: as :meth:`cast`, except that where the semantics
        computes fp8 ops in fp16 the result is rounded twice, float32 -> fp16 -> fp8."""
        if self.semantics.fp8_ops_in_fp16 and self.fmt.bits == 8:
            return quantize(quantize(np.asarray(a, F32), _FP16), self.fmt)
        return self.cast(a)

    def fma_result(self, a, b, c) -> np.ndarray:
        """a * b + c of compute-format values as one FMA in the compute format: the exact value
        (a float64 sum rounded to odd, so the next rounding is correct) rounded once.  Only f16
        has such an instruction (AVX512-FP16's ``vfmadd...sh``), which ignores FTZ and DAZ."""
        if self.fmt.name != "fp16":
            raise ValueError(f"an FMA in the compute format exists for fp16 only, not {self.fmt.name}")
        exact = np.asarray(a, F32).astype(np.float64) * np.asarray(b, F32)  # exact: 11-bit significands
        with np.errstate(**_NO_FLAGS):
            return _odd_sum(exact, np.asarray(c, F32).astype(np.float64)).astype(np.float16).astype(F32)

    def fuses_fp16_bias_add(self, inner: int) -> bool:
        """Whether ``act @ w + b`` is one f16 FMA: on AVX512-FP16, where the contraction ``inner``
        is 1 and XLA fuses the multiply with the bias add (``StepSemantics.fp16_fma``)."""
        return self.semantics.fp16_fma and self.fmt.name == "fp16" and inner == 1

    @property
    def excess_precision(self) -> bool:
        """Whether the semantics' excess precision applies to this compute format.  In XLA it is
        bf16's alone: XLA:CPU computes bf16 ops in float32 and may drop the round trips between
        them, while it computes f16 ops natively, each rounded, in both modes."""
        return self.semantics.excess_precision and self.fmt.name == "bf16"

    # -- matmuls -----------------------------------------------------------
    def dot(self, a, b, role: str) -> np.ndarray:
        """a @ b of compute-format values, accumulated in float32 and *not* yet rounded.

        ``role`` is ``"forward"`` (x @ w) or ``"grad_w"`` (x.T @ cotangent): the XLA:CPU
        order depends on which dot it is and on the shape.
        """
        order = self.semantics.dot
        if order == "blas":
            with np.errstate(**_NO_FLAGS):
                product = np.matmul(a, b)
            return self._round(product.astype(np.float64)) if self.semantics.flush_subnormals else product
        if order == "sequential":
            return _chain(self, a, b, "fma0" if self.semantics.fma else "add0")
        if order == "torch_cpu":
            return _chain(self, a, b, _torch_cpu_dot_mode(a, b, role))
        return _xla_cpu_dot(self, a, b, role)

    # -- reductions --------------------------------------------------------
    def sum_of_squares(self, e: np.ndarray, rows: int, inner: int) -> np.ndarray:
        """sum(e * e) over the flattened (rows, -1) array ``e`` in the semantics' order.

        ``inner`` is the contraction length of the dot that produced e: XLA turns a contraction
        of 1 into a multiply, which changes the loss fusion's code for fp8.
        """
        order = self.semantics.reduce
        flat = e.reshape(-1)
        if order == "pairwise":
            with np.errstate(**_NO_FLAGS):
                return np.sum(self.mul(flat, flat), dtype=F32)
        if order == "torch_cpu":
            return _torch_cpu_sum(self, self.mul(flat, flat))
        if order == "inductor_cpu":
            return _inductor_cpu_sum(self, self.mul(flat, flat))
        if order == "sequential":
            total = F32(0)
            for value in flat:
                total = self.mul_add(value, value, total)
            return total
        if self.fmt.bits == 8:
            return _xla_cpu_fp8_sum_of_squares(self, e.reshape(rows, -1), inner)
        return _xla_cpu_sum_of_squares(self, e.reshape(rows, -1))

    def vector_sum(self, values: np.ndarray) -> np.ndarray:
        """torch.compile's full reduction of a small float32 buffer: one masked 16-lane
        accumulator from +0, the ``vec_reduce_all`` butterfly, then ``0 + lane 0``.  Inductor
        emits it for every ``sum`` over all elements (the loss, and in the decomposed matmuls of
        docs/steps.md a dot over D or a bias gradient over B).  1-d values fill lanes 0..n-1
        (a flat loop); 2-d values (rows, cols) are a loop over rows with the columns in the
        lanes, so lane j accumulates column j row by row."""
        return _inductor_cpu_sum(self, np.asarray(values, F32))

    def batch_sum(self, ct: np.ndarray) -> np.ndarray:
        """Sum of the cotangent rows (the bias gradient), rounded to the compute format unless
        ``bias_grad_rounded`` is False."""
        if self.semantics.reduce == "inductor_cpu":  # unrolled pointwise sum: ((r0 + r1) + r2) + r3
            total = ct[0]
            for row in ct[1:]:
                total = self.add(total, row)
            return self.round_result(total) if self.semantics.bias_grad_rounded else total
        if self.semantics.reduce == "pairwise":
            with np.errstate(**_NO_FLAGS):
                return self.round_result(np.sum(ct, axis=0, dtype=F32))
        if self.semantics.bias_grad_rounds_partials:
            if ct.shape[0] == 1:  # XLA: a one-row reduce is a copy
                return ct[0]
            total = np.zeros(ct.shape[1], F32)
            for row in ct:
                total = self.round_result(self.add(total, row))  # the bf16 reducer rounds every partial sum
            return total
        total = np.zeros(ct.shape[1], F32)
        for row in ct:
            total = self.add(total, row)  # float32 accumulator from +0 ...
        return self.round_result(total) if self.semantics.bias_grad_rounded else total  # ... rounded once


def _chain(k: Kernel, a: np.ndarray, b: np.ndarray, mode: str) -> np.ndarray:
    """(M, L) @ (L, N) in float32, sequential over l.

    ``fma0``: t = +0, t = fma(a_l, b_l, t); ``fmap0``: t = a_0 * b_0, then fma;
    ``seq``: t = a_0 * b_0, then t + a_l * b_l (rounded separately); ``add0``: t = +0,
    then t + a_l * b_l; ``mul``: L == 1, a plain product.
    """
    terms = [(a[:, l:l + 1], b[l:l + 1, :]) for l in range(a.shape[1])]
    if mode in ("fmap0", "seq", "mul"):
        total, terms = k.mul(*terms[0]), terms[1:]
    else:
        total = np.zeros((a.shape[0], b.shape[1]), F32)
    for left, right in terms:
        total = k.fma(left, right, total) if mode in ("fma0", "fmap0") else k.add(total, k.mul(left, right))
    return total


def _torch_cpu_dot_mode(a: np.ndarray, b: np.ndarray, role: str) -> str:
    """torch 2.13's CPU bf16 matmul, fitted on overflowing and underflowing products.

    ``x @ w`` (contiguous operands): products rounded, then summed from +0 (two products of
    +-2^128 give NaN; an underflowing product gives +0).  ``x.T @ ct`` (the weight gradient,
    a transposed operand): fused multiply-adds from +0 (an underflowing product keeps its
    sign, -0; +-2^128 gives inf), except for a one-term contraction (B == 1) into a vector
    (D == 1 or K == 1), which is rounded then added to +0.
    """
    batch, rows, cols = a.shape[1], a.shape[0], b.shape[1]
    if role == "grad_w" and not (batch == 1 and (rows == 1 or cols == 1)):
        return "fma0"
    return "add0"


def _two_output_gemv(k: Kernel, a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
    """Eigen's GEMV with two outputs and a contraction of 3 or more: the first output is
    accumulated unfused (``seq``), the second fused (``fmap0``)."""
    if axis == 1:
        parts = [_chain(k, a, b[:, 0:1], "seq"), _chain(k, a, b[:, 1:2], "fmap0")]
    else:
        parts = [_chain(k, a[0:1], b, "seq"), _chain(k, a[1:2], b, "fmap0")]
    return np.concatenate(parts, axis=axis)


def _paired(k: Kernel, a: np.ndarray, b: np.ndarray, mode: str) -> np.ndarray:
    """Two accumulators over the contraction, even and odd terms, each a ``mode`` chain from +0,
    then even + odd."""
    return k.add(_chain(k, a[:, 0::2], b[0::2], mode), _chain(k, a[:, 1::2], b[1::2], mode))


def _xla_cpu_dot(k: Kernel, a: np.ndarray, b: np.ndarray, role: str) -> np.ndarray:
    """XLA:CPU's dot of compute-format values: an f32 dot of the upcast operands, fitted by
    probing each dot of the step alone (``lax.dot_general`` with the optimized HLO's shapes) with
    overflowing, underflowing and signed-zero products (docs/steps.md).

    The rules are those of oneDNN's AVX2 sgemm; on its AVX-512 kernel (``StepSemantics.avx512_sgemm``)
    the matrix-matrix dots that :func:`_paired` takes are plain ``fma0`` chains.

    forward x (B, D) @ w (D, K): D == 1 multiply; B == 1: ``fmap0``, the two-output GEMV when
    K == 2 and D >= 3, ``fma0`` when K == 1 too (a reduce); K == 1: ``fma0`` then ``+ 0`` (the
    GEMV's empty vector tile is added to its scalar tail); D == 4 with 4 rows or columns:
    :func:`_paired`; otherwise ``fma0``.
    grad_w x.T (D, B) @ ct (B, K): B == 1 multiply; one of D, K is 1: ``fmap0``, or the
    two-output GEMV when D * K == 2 and B >= 3; B == 4 with D or K == 4: :func:`_paired`;
    otherwise ``fma0``.  :func:`_paired` is fused except where XLA's dot has two rows (the
    forward's B == 2, the weight gradient's K == 2: XLA computes it as ct.T @ x).
    """
    rows, inner, cols = a.shape[0], a.shape[1], b.shape[1]
    if inner == 1:
        return _chain(k, a, b, "mul")
    hlo_rows = rows if role == "forward" else cols
    if role == "forward" and rows == 1:
        if cols == 2 and inner >= 3:
            return _two_output_gemv(k, a, b, axis=1)
        return _chain(k, a, b, "fmap0" if cols > 1 else "fma0")
    if role == "forward" and cols == 1:
        return k.add(F32(0), _chain(k, a, b, "fma0"))
    if role != "forward" and (rows == 1) != (cols == 1):
        if rows * cols == 2 and inner >= 3:
            return _two_output_gemv(k, a, b, axis=1 if rows == 1 else 0)
        return _chain(k, a, b, "fmap0")
    if not k.semantics.avx512_sgemm and inner == 4 and max(rows, cols) == 4 and min(rows, cols) >= 2:
        return _paired(k, a, b, "fma0" if hlo_rows >= 3 else "add0")
    return _chain(k, a, b, "fma0")


def _xla_cpu_sum_of_squares(k: Kernel, e: np.ndarray) -> np.ndarray:
    """XLA:CPU's reduce of e * e: the adds carry ``reassoc`` and mul + add become FMAs.

    n == 1: e * e.  One row or one column: fma chain started from e0*e0 + e1*e1.  Two or
    three rows: fma chain from +0 in row-major order.  Four rows: one fma chain per row,
    combined as (r0 + r2) + (r1 + r3).
    """
    rows, cols = e.shape
    flat = e.reshape(-1)
    if flat.size == 1:
        return k.mul(flat[0], flat[0])
    if rows == 1 or cols == 1:
        return _fma_squares(k, flat[2:], k.fma(flat[0], flat[0], k.mul(flat[1], flat[1])))
    if rows != 4:
        return _fma_squares(k, flat, F32(0))
    return _four_lane_sum(k, [_fma_squares(k, row, F32(0)) for row in e])


def _fma_squares(k: Kernel, values, total):
    """total + sum of value * value, one fused multiply-add at a time, in order."""
    for value in values:
        total = k.fma(value, value, total)
    return total


def _four_lane_sum(k: Kernel, lanes: list):
    """A 4-lane vector reduced as x86 code folds it: (l0 + l2) + (l1 + l3)."""
    return k.add(k.add(lanes[0], lanes[2]), k.add(lanes[1], lanes[3]))


def _xla_cpu_fp8_sum_of_squares(k: Kernel, e: np.ndarray, inner: int) -> np.ndarray:
    """XLA:CPU's reduce of e * e in a fusion that holds fp8 converts (read in the optimized LLVM IR
    and the object code of ``reduce_multiply_fusion``; fitted for B, D, K in 1..4).

    K >= 3: a loop over rows, each row one 4-lane vector: lane 0 = fma(e0, e0, acc), lane i =
    e_i * e_i (an fma with -0), missing lanes -0; then acc = (l0 + l2) + (l1 + l3).  K == 2, or
    K == 1 with B <= 2: one fma chain from +0 in row-major order.  K == 1, B >= 3: the column as
    one 4-lane vector of squares, reduced the same way.  Some small shapes compile to the bf16
    step's code instead (:func:`_fp8_loss_sums_as_bf16`).
    """
    rows, cols = e.shape
    if _fp8_loss_sums_as_bf16(k.fmt.name, rows, inner, cols):
        return _xla_cpu_sum_of_squares(k, e)
    if cols == 2 or (cols == 1 and rows <= 2):
        return _fma_squares(k, e.reshape(-1), F32(0))
    if cols == 1:
        return _four_lane_sum(k, [k.mul(value, value) for value in e[:, 0]] + [F32(0)] * (4 - rows))
    total = F32(0)
    for row in e:
        lanes = [k.fma(row[0], row[0], total)] + [k.mul(value, value) for value in row[1:]]
        total = _four_lane_sum(k, lanes + [F32(-0.0)] * (4 - cols))
    return total


def _fp8_loss_sums_as_bf16(fmt_name: str, batch: int, inner: int, out: int) -> bool:
    """The small fp8 shapes whose loss sum runs in the bf16 step's order, as probed on jax 0.10
    for B, D, K in 1..4 (``inner`` is D; D == 1 turns the dot into a multiply): for e5m2, K <= 2
    except where D == 1 and B != 2; for e4m3fn, only B == 2, K == 1, D >= 2.  An outcome of
    LLVM's vectorizer on each type's convert code, recorded rather than derived."""
    if fmt_name == "fp8_e5m2":
        return out <= 2 and not (inner == 1 and batch != 2)
    return batch == 2 and out == 1 and inner >= 2


_TORCH_LANES = 8  # ATen's Vectorized<float> width in its sum kernel here (measured: docs/steps.md)
_TORCH_ILP = 4


def _torch_cpu_sum(k: Kernel, values: np.ndarray) -> np.ndarray:
    """ATen's CPU sum of a contiguous float32 vector (no cascade: fewer than 64 * 8 values).

    Below 8 values: 4 accumulators take v[i] for i = 0, 1, 2, 3 mod 4 of the first 4 * (n // 4)
    values, the tail goes to accumulator 0, then acc0 + acc1 + acc2 + acc3.  From 8 values:
    the same 4-way scheme over 8-lane vectors; then +0 plus the scalar tail, plus the 8 lanes
    in order.
    """
    n = values.size
    if n >= 16 * _TORCH_ILP * _TORCH_LANES:
        raise ValueError(f"the torch_cpu sum order is modelled for fewer than "
                         f"{16 * _TORCH_ILP * _TORCH_LANES} values, got {n}")
    if n < _TORCH_LANES:
        return _ilp_sum(k, list(values))
    vectors = n // _TORCH_LANES
    lanes = _ilp_sum(k, [values[i * _TORCH_LANES:(i + 1) * _TORCH_LANES] for i in range(vectors)])
    total = F32(0)
    for value in list(values[vectors * _TORCH_LANES:]) + list(lanes):
        total = k.add(total, value)
    return total


def _ilp_sum(k: Kernel, items: list):
    """ATen's row_sum: 4 interleaved accumulators from +0, tail into the first, then combined."""
    accumulators = [np.zeros_like(np.asarray(items[0], F32)) for _ in range(_TORCH_ILP)]
    full = len(items) // _TORCH_ILP * _TORCH_ILP
    for i, item in enumerate(items):
        slot = i % _TORCH_ILP if i < full else 0
        accumulators[slot] = k.add(accumulators[slot], item)
    total = accumulators[0]
    for accumulator in accumulators[1:]:
        total = k.add(total, accumulator)
    return total


_INDUCTOR_LANES = 16  # inductor's Vectorized<float> width on an AVX-512 CPU


def _inductor_cpu_sum(k: Kernel, values: np.ndarray) -> np.ndarray:
    """torch.compile's CPU sum of up to 16 float32 values (docs/steps.md).

    The generated kernel adds the values into one 16-lane accumulator from +0
    (``sum_masked_reduce``; unused lanes stay +0), then ``vec_reduce_all`` folds it with
    AVX-512 shuffles: lane i += lane i ^ 8, then ^ 4, ^ 2, ^ 1; then ``0 + lane 0``.
    2-d values (rows, cols): a loop over rows, each row's cols added into lanes 0..cols-1.
    """
    rows = values.reshape(1, -1) if values.ndim < 2 else values
    if rows.shape[1] > _INDUCTOR_LANES or (values.ndim < 2 and values.size > _INDUCTOR_LANES):
        raise ValueError(f"the inductor_cpu sum order is modelled for at most {_INDUCTOR_LANES} lanes, "
                         f"got {values.shape}")
    lanes = [F32(0)] * _INDUCTOR_LANES
    for row in rows:
        for i, value in enumerate(row):
            lanes[i] = k.add(lanes[i], value)
    stride = _INDUCTOR_LANES // 2
    while stride:
        lanes = [k.add(lanes[i], lanes[i ^ stride]) for i in range(_INDUCTOR_LANES)]
        stride //= 2
    return k.add(F32(0), lanes[0])
