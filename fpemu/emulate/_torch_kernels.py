"""The float32 op run as the CPU kernel torch picks for the emulated dtype, where the two differ.

The emulation computes an op in float32 and rounds once.  For most ops torch's float16 / bfloat16
CPU kernel does the same with the float32 kernel's code, so the emulation equals it bit for bit; a
few ops pick another library by dtype:

* ``gelu`` and ``gelu_backward`` (``approximate='none'``; on aarch64 also gelu's ``'tanh'``) call
  oneDNN's eltwise gelu_erf for a contiguous input of more than one element that is float32, or
  bfloat16 where oneDNN computes bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: an x86 CPU
  with AVX512 or AVX2-VNNI-2, as ``ONEDNN_MAX_CPU_ISA`` caps it); otherwise, float16 always, ATen's
  own vectorized kernel (torch 2.13 aten/src/ATen/native/Activation.cpp, ``use_mkldnn``).  The two
  evaluate erf differently: where ``1 + erf`` cancels (x < -3) they are ulps of the low format apart.
  So the float32 op runs with oneDNN switched off where the real dtype's call would not use it.
* oneDNN's bfloat16 store on a CPU with AVX512_BF16 converts with VCVTNEPS2BF16, which reads float32
  subnormals as zero: its bf16 gelu is its float32 gelu with subnormal results flushed to signed zero
  (on all 65536 bf16 inputs; with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` nothing is flushed).  Whether
  the store flushes is measured once, on the running torch.

Checked with torch 2.13.0+cpu (oneDNN 3.12) on an AMD EPYC with AVX512_BF16, under ATen's DEFAULT,
AVX2 and AVX512 tiers (``ATEN_CPU_CAPABILITY``) and oneDNN capped at AVX2, AVX512_CORE and its
default (tests/test_emulate_torch.py runs the AVX2 machine's tiers in a subprocess).

Other ops' CPU kernels for float16 / bfloat16 inputs are no float32 computation rounded once at all
(``CPU_LOW_KERNELS``: oneDNN's blocked convolutions, batch norm's mixed-dtype statistics, pooling
gradients summed in the low dtype).  A ResNet's step-0 gradients amplify their last-bit differences
to tens of percent (its batch-norm bias gradients cancel), so under the CPU table, with the rounding
real autocast has, those ops run torch's own low-precision CPU kernel: the real run's call, on the
real run's dtypes.  Under the CUDA table they compute in float32 and round once, as CUDA's kernels
(float32 opmath and accumulators) do.
"""

from __future__ import annotations

import contextlib
import functools
import platform

import torch

# op -> the position of the input whose dtype and layout torch's use_mkldnn reads
_ONEDNN_GELU = {"aten::gelu": 0, "aten::gelu_": 0, "aten::gelu_backward": 1}
_AARCH64 = platform.machine() in ("aarch64", "arm64")
_BF16_MIN_NORMAL = 2.0 ** -126

# (On AVX512_BF16 and below; oneDNN's AVX512_CORE_FP16 and AMX convolutions, on a Sapphire Rapids, rounded
# the test's samples once: running torch's kernel is exact on every tier.)
_BLOCKED = "oneDNN's low-precision convolution accumulates its blocks of products in another order"
_STATISTICS = ("the mixed-dtype kernel (low input, float32 weight and statistics) reduces in another "
               "order than the float32 kernel")
_LOW_SUMS = "the gradient of overlapping or shared windows is summed in the low dtype, each add rounded"
_FLASH = ("the fused attention rounds its blocks' probabilities to the low dtype before multiplying them "
          "by the values, and keeps a running softmax over blocks")
_RNN = ("oneDNN's bf16 LSTM rounds its gates to bf16 between steps; in float16 oneDNN has no LSTM here "
        "and torch's call fails (torch's own error, as in the real run)")
# op -> why torch's float16 / bfloat16 CPU kernel is no float32 computation rounded once (measured
# with torch 2.13.0+cpu on AVX512_BF16, benchmarks/emulate_ops.py; tests/test_emulate_torch.py
# checks that each departs from it on a sample and that the emulation equals it there)
CPU_LOW_KERNELS = {
    "aten::convolution": _BLOCKED, "aten::convolution_backward": _BLOCKED,
    "aten::native_batch_norm": _STATISTICS, "aten::native_batch_norm_backward": _STATISTICS,
    "aten::native_group_norm_backward": _STATISTICS, "aten::native_layer_norm_backward": _STATISTICS,
    "aten::max_pool2d_with_indices_backward": _LOW_SUMS, "aten::avg_pool2d_backward": _LOW_SUMS,
    "aten::_adaptive_avg_pool2d_backward": _LOW_SUMS,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _FLASH,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _FLASH,
    "aten::mkldnn_rnn_layer": _RNN, "aten::mkldnn_rnn_layer_backward": _RNN,
    "aten::pow": "the vectorized kernel multiplies out small exponents in the low dtype (x * x * x, rounded "
                 "twice) and takes a square root for 0.5 in it",
}


# CPU_LOW_KERNELS ops with no float32 call to count their rounding against: the backward of oneDNN's
# LSTM reads the workspace its low forward wrote, which a float32 call misreads (a segfault, torch 2.13).
# Their low results are counted as they are (no underflow seen; a non-finite one as the op's own).
NO_FLOAT32_CALL = {"aten::mkldnn_rnn_layer_backward"}


def runs_low_kernel(packet: str, policy) -> bool:
    """Whether the emulation runs torch's own low-precision CPU kernel for the op (``CPU_LOW_KERNELS``):
    under the CPU table and the rounding real autocast has (nearest even, inf on overflow, subnormals,
    float32 accumulation); any other policy asks for a rounding torch's kernel does not do."""
    return (packet in CPU_LOW_KERNELS and policy.placement == "autocast" and policy.table_device == "cpu"
            and policy.rounding == "nearest_even" and policy.overflow == "inf" and policy.subnormals
            and policy.accumulation == "fp32")


def _onednn_modes(packet: str) -> tuple:
    """The approximate modes torch sends to oneDNN (its aarch64 build also gelu's tanh; read, not run)."""
    return ("none", "tanh") if _AARCH64 and packet != "aten::gelu_backward" else ("none",)


def _takes_onednn(packet: str, args, kwargs, dtype) -> bool | None:
    """Whether torch's CPU call of the op on ``dtype`` tensors laid out as ``args`` runs oneDNN;
    None for ops whose kernel does not depend on it."""
    position = _ONEDNN_GELU.get(packet)
    if position is None:
        return None
    if kwargs.get("approximate", "none") not in _onednn_modes(packet):
        return False
    tensor = args[position]
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and tensor.is_contiguous() and tensor.numel() > 1
                and (dtype == torch.float32
                     or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())))


@contextlib.contextmanager
def _without_onednn():
    saved = torch.backends.mkldnn.set_flags(_enabled=False, _fp32_precision=None)
    try:
        yield
    finally:
        torch.backends.mkldnn.set_flags(_enabled=saved[0], _fp32_precision=None)


@functools.lru_cache(maxsize=None)
def _bf16_store_flushes() -> bool:
    """Whether oneDNN's bf16 gelu flushes a subnormal result (of the min normal input) to zero."""
    return bool(torch.nn.functional.gelu(torch.full((2,), _BF16_MIN_NORMAL, dtype=torch.bfloat16))[0] == 0)


def _flush_subnormals(out) -> None:
    """Subnormal float32 results to zero of their sign, in place (the tensors stay the op's own)."""
    for tensor in out if isinstance(out, (tuple, list)) else (out,):
        tensor.copy_(torch.where(tensor.abs() < _BF16_MIN_NORMAL, tensor * 0, tensor))


def run_as_low_kernel(run, packet: str, args, kwargs, dtype):
    """``run()`` (the op on float32 copies of ``args``) computed as torch's CPU kernel for ``dtype``
    tensors laid out as ``args`` computes it before rounding (see the module docstring)."""
    onednn = _takes_onednn(packet, args, kwargs, dtype)
    if onednn is None:
        return run()
    if not onednn:
        with _without_onednn():
            return run()
    out = run()
    if dtype == torch.bfloat16 and _bf16_store_flushes():
        _flush_subnormals(out)
    return out
