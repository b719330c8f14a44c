"""A sample call of every op torch's autocast tables place, for the op-by-op differential tests.

``SAMPLES`` maps each op of the installed torch's AutocastCPU and AutocastCUDA registrations (as
:func:`fpemu.emulate.op_table` names them) to the shapes of its floating inputs and the arguments
built from them; ``CPU_LESS`` names the ops that have no CPU kernel, with the reason.
tests/test_emulate_ops.py checks that the two cover both tables, and compares each op as emulated
with torch CPU's own result; benchmarks/emulate_ops.py writes the ulp histogram of every op.

The inputs are seeded standard normal values rounded to the low format (the arguments are built in
float32 from them, then every floating argument is rounded to the low format, so both sides of a
comparison read the same values).  Only torch is needed (imported on first use).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class Sample:
    """How to call one op.

    Attributes:
      shapes: the shapes of the seeded normal float32 tensors the arguments are built from.
      build: tensors -> the op's positional arguments (None: the tensors themselves).
    """

    shapes: tuple
    build: Optional[Callable] = None


# Ops with no CPU kernel (CUDA-only libraries and kernels): nothing to compare on the CPU.
CPU_LESS = {
    "aten::cudnn_convolution": "a cuDNN kernel (CUDA only)",
    "aten::cudnn_convolution_transpose": "a cuDNN kernel (CUDA only)",
    "aten::_scaled_dot_product_flash_attention": "FlashAttention's CUDA kernel (the CPU's is "
                                                 "_scaled_dot_product_flash_attention_for_cpu)",
    "aten::_thnn_fused_lstm_cell": "a fused CUDA kernel (the CPU runs lstm_cell's composite)",
    "aten::_thnn_fused_gru_cell": "a fused CUDA kernel (the CPU runs gru_cell's composite)",
}


def _samples(torch) -> dict:
    long = lambda *values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    signs = lambda n: torch.tensor([1.0, -1.0] * (n // 2))  # noqa: E731
    spd = lambda a: a @ a.T + 4 * torch.eye(a.shape[0])  # noqa: E731 - symmetric positive definite
    well = lambda a: a + 4 * torch.eye(a.shape[0])  # noqa: E731 - well conditioned
    lower = lambda a: a.tril() + (a.diag().abs() + 1).diag() - a.diag().diag()  # noqa: E731
    unit = lambda a: a.clamp(-0.9, 0.9)  # noqa: E731
    positive = lambda a: a.abs() + 0.125  # noqa: E731
    grid2 = lambda x, g: (x, g.clamp(-1, 1), 0, 0, False)  # noqa: E731
    conv = ((2, 4, 32), (6, 4, 3))
    conv2 = ((2, 4, 8, 8), (6, 4, 3, 3))
    conv3 = ((1, 2, 4, 4, 4), (3, 2, 2, 2, 2))
    mat, vec, image, volume = (8, 16), (16,), (1, 2, 4, 4), (1, 1, 3, 3, 3)
    lstm = ((3, 8), (3, 4), (3, 4), (16, 8), (16, 4), (16,), (16,))
    rnn = ((3, 8), (3, 4), (4, 8), (4, 4), (4,), (4,))
    gru = ((3, 8), (3, 4), (12, 8), (12, 4), (12,), (12,))
    S = Sample
    conv_args = lambda x, w: (x, w, None, [1], [0], [1], False, [0], 1)  # noqa: E731
    return {
        # -- matrix products, convolutions, attention, rnn cells (autocast's lower_precision_fp) --
        "aten::_addmm_activation": S(((8,), (4, 64), (64, 8))),
        "aten::_convolution": S(conv, lambda x, w: conv_args(x, w) + (False, False, True, True)),
        "aten::_convolution.deprecated": S(conv, lambda x, w: conv_args(x, w) + (False, False, True)),
        "aten::_native_multi_head_attention": S(((2, 5, 8),) * 3 + ((24, 8), (24,), (8, 8), (8,)),
                                                lambda q, k, v, w, b, pw, pb: (q, k, v, 8, 2, w, b, pw, pb)),
        "aten::addbmm": S(((4, 4), (3, 4, 64), (3, 64, 4))),
        "aten::addmm": S(((4, 8), (4, 64), (64, 8))),
        "aten::addmv": S(((4,), (4, 64), (64,))),
        "aten::addr": S(((4, 8), (4,), (8,))),
        "aten::baddbmm": S(((3, 4, 8), (3, 4, 64), (3, 64, 8))),
        "aten::bmm": S(((3, 4, 64), (3, 64, 8))),
        "aten::chain_matmul": S(((4, 64), (64, 8), (8, 4)), lambda a, b, c: ([a, b, c],)),
        "aten::linalg_multi_dot": S(((4, 64), (64, 8), (8, 4)), lambda a, b, c: ([a, b, c],)),
        "aten::conv1d": S(conv),
        "aten::conv1d.padding": S(conv, lambda x, w: (x, w, None, [1], "same")),
        "aten::conv2d": S(conv2),
        "aten::conv2d.padding": S(conv2, lambda x, w: (x, w, None, [1, 1], "same")),
        "aten::conv3d": S(conv3),
        "aten::conv3d.padding": S(conv3, lambda x, w: (x, w, None, [1, 1, 1], "same")),
        "aten::conv_tbc": S(((16, 2, 4), (3, 4, 6), (6,)), lambda x, w, b: (x, w, b, 1)),
        "aten::conv_transpose1d": S(((2, 4, 16), (4, 6, 3))),
        "aten::conv_transpose2d.input": S(((2, 4, 5, 5), (4, 6, 3, 3))),
        "aten::conv_transpose3d.input": S(((1, 2, 3, 3, 3), (2, 3, 2, 2, 2))),
        "aten::convolution": S(conv, conv_args),
        "aten::einsum": S(((4, 64), (64, 8)), lambda a, b: ("ij,jk->ik", [a, b])),
        "aten::gru_cell": S(gru),
        "aten::lstm_cell": S(lstm, lambda x, h, c, wi, wh, bi, bh: (x, [h, c], wi, wh, bi, bh)),
        "aten::rnn_relu_cell": S(rnn),
        "aten::rnn_tanh_cell": S(rnn),
        "aten::linalg_vecdot": S(((4, 64), (4, 64))),
        "aten::linear": S(((4, 64), (8, 64), (8,))),
        "aten::matmul": S(((2, 4, 64), (64, 8))),
        "aten::mkldnn_rnn_layer": S(((5, 2, 4), (12, 4), (12, 3), (12,), (12,), (2, 3), (2, 3)),
                                    lambda x, wi, wh, bi, bh, h, c: (x, wi, wh, bi, bh, h, c, False, [], 2, 3, 1,
                                                                     True, False, False, False)),
        "aten::mm": S(((4, 64), (64, 8))),
        "aten::mv": S(((4, 64), (64,))),
        "aten::prelu": S(((4, 6), (6,))),
        "aten::scaled_dot_product_attention": S(((2, 2, 5, 8),) * 3),
        # -- ops autocast promotes to the widest input --
        "aten::addcdiv": S((vec, vec, vec), lambda a, b, c: (a, b, positive(c))),
        "aten::addcmul": S((vec, vec, vec)),
        "aten::atan2": S((vec, vec)),
        "aten::bilinear": S(((3, 4), (3, 5), (6, 4, 5), (6,))),
        "aten::cat": S(((3, 4), (3, 4)), lambda a, b: ([a, b],)),
        "aten::stack": S(((3, 4), (3, 4)), lambda a, b: ([a, b],)),
        "aten::cross": S(((4, 3), (4, 3)), lambda a, b: (a, b, 1)),
        "aten::dot": S(((64,), (64,))),
        "aten::vdot": S(((64,), (64,))),
        "aten::grid_sampler": S((image, (1, 3, 3, 2)), grid2),
        "aten::index_copy": S(((5, 4), (2, 4)), lambda s, src: (s, 0, long(0, 3), src)),
        "aten::index_put": S(((5,), (2,)), lambda s, v: (s, [long(1, 3)], v)),
        "aten::scatter_add": S(((5, 4), (2, 4)), lambda s, src: (s, 0, long(0, 1, 2, 3, 4, 3, 2, 1).reshape(2, 4),
                                                               src)),
        "aten::tensordot": S(((3, 4, 5), (4, 5, 2)), lambda a, b: (a, b, [1, 2], [0, 1])),
        # -- ops autocast runs in float32: pointwise, reductions, losses, normalizations, resampling --
        "aten::acos": S((vec,), lambda a: (unit(a),)),
        "aten::asin": S((vec,), lambda a: (unit(a),)),
        "aten::cosh": S((vec,)),
        "aten::sinh": S((vec,)),
        "aten::tan": S((vec,), lambda a: (unit(a),)),
        "aten::erfinv": S((vec,), lambda a: (unit(a),)),
        "aten::exp": S((vec,)),
        "aten::expm1": S((vec,)),
        "aten::log": S((vec,), lambda a: (positive(a),)),
        "aten::log10": S((vec,), lambda a: (positive(a),)),
        "aten::log1p": S((vec,), lambda a: (positive(a),)),
        "aten::log2": S((vec,), lambda a: (positive(a),)),
        "aten::reciprocal": S((vec,)),
        "aten::rsqrt": S((vec,), lambda a: (positive(a),)),
        "aten::softplus": S((vec,)),
        "aten::pow.Scalar": S((vec,), lambda a: (2.0, a)),
        "aten::pow.Tensor_Scalar": S((vec,), lambda a: (positive(a), 2.5)),
        "aten::pow.Tensor_Tensor": S((vec, vec), lambda a, b: (positive(a), b)),
        "aten::fake_quantize_per_tensor_affine": S((vec,), lambda a: (a, 0.125, 0, -128, 127)),
        "aten::polar": S((vec, vec), lambda a, b: (a.abs(), b)),
        "aten::view_as_complex": S(((4, 2),)),
        "aten::cumprod": S(((8,),), lambda a: (a, 0)),
        "aten::cumsum": S(((64,),), lambda a: (a, 0)),
        "aten::prod": S(((8,),)),
        "aten::prod.dim_int": S(((4, 8),), lambda a: (a, 1)),
        "aten::sum": S(((64,),)),
        "aten::sum.dim_IntList": S((mat,), lambda a: (a, [1])),
        "aten::logsumexp": S((mat,), lambda a: (a, [1])),
        "aten::softmax.int": S((mat,), lambda a: (a, -1)),
        "aten::log_softmax.int": S((mat,), lambda a: (a, -1)),
        "aten::trace": S(((4, 4),)),
        "aten::dist": S((vec, vec)),
        "aten::cdist": S(((4, 8), (5, 8))),
        "aten::pdist": S(((5, 3),)),
        "aten::cosine_similarity": S(((4, 8), (4, 8))),
        "aten::norm.Scalar": S((mat,), lambda a: (a, 2)),
        "aten::norm.ScalarOpt_dim": S((mat,), lambda a: (a, 2, [1])),
        "aten::frobenius_norm.dim": S((mat,), lambda a: (a, [1])),
        "aten::nuclear_norm": S(((4, 4),)),
        "aten::nuclear_norm.dim": S(((4, 4),), lambda a: (a, [0, 1])),
        "aten::linalg_vector_norm": S((mat,), lambda a: (a, 2)),
        "aten::linalg_matrix_norm": S(((4, 4),), lambda a: (a, 1)),
        "aten::linalg_matrix_norm.str_ord": S(((4, 4),), lambda a: (a, "fro")),
        "aten::renorm": S((mat,), lambda a: (a, 2, 0, 1.0)),
        "aten::layer_norm": S((mat,), lambda a: (a, [16])),
        "aten::native_layer_norm": S((mat,), lambda a: (a, [16], None, None, 1e-5)),
        "aten::group_norm": S(((2, 4, 3),), lambda a: (a, 2)),
        "aten::rms_norm": S((mat,), lambda a: (a, [16])),
        "aten::binary_cross_entropy": S((vec, vec), lambda a, b: (a.sigmoid(), b.sigmoid())),
        "aten::binary_cross_entropy_with_logits": S((vec, vec), lambda a, b: (a, b.sigmoid())),
        "aten::cross_entropy_loss": S(((4, 5),), lambda a: (a, long(0, 1, 2, 3))),
        "aten::nll_loss": S(((4, 5),), lambda a: (a.log_softmax(-1), long(0, 1, 2, 3))),
        "aten::nll_loss2d": S(((1, 3, 2, 2),), lambda a: (a.log_softmax(1), long(0, 1, 2, 1).reshape(1, 2, 2))),
        "aten::ctc_loss.IntList": S(((6, 2, 4),), lambda a: (a.log_softmax(-1), long(1, 2, 1, 3).reshape(2, 2),
                                                            [6, 6], [2, 2])),
        "aten::ctc_loss.Tensor": S(((6, 2, 4),), lambda a: (a.log_softmax(-1), long(1, 2, 1, 3).reshape(2, 2),
                                                           long(6, 6), long(2, 2))),
        "aten::cosine_embedding_loss": S(((4, 8), (4, 8)), lambda a, b: (a, b, signs(4))),
        "aten::hinge_embedding_loss": S((vec,), lambda a: (a, signs(16))),
        "aten::margin_ranking_loss": S((vec, vec), lambda a, b: (a, b, signs(16))),
        "aten::soft_margin_loss": S((vec,), lambda a: (a, signs(16))),
        "aten::huber_loss": S((vec, vec)),
        "aten::l1_loss": S((vec, vec)),
        "aten::mse_loss": S((vec, vec)),
        "aten::smooth_l1_loss": S((vec, vec)),
        "aten::kl_div": S(((4, 5), (4, 5)), lambda a, b: (a.log_softmax(-1), b.softmax(-1))),
        "aten::poisson_nll_loss": S((vec, vec), lambda a, b: (a, b.abs(), True, False, 1e-8, 1)),
        "aten::multi_margin_loss": S(((4, 5),), lambda a: (a, long(0, 1, 2, 3))),
        "aten::multilabel_margin_loss": S(((2, 4),), lambda a: (a, long(0, 2, -1, 0, 1, -1, 0, 0).reshape(2, 4))),
        "aten::multilabel_margin_loss_forward": S(((2, 4),), lambda a: (a, long(0, 2, -1, 0, 1, -1, 0, 0).reshape(2, 4),
                                                                      1)),
        "aten::triplet_margin_loss": S(((4, 8),) * 3),
        "aten::quantile": S(((16,),), lambda a: (a, torch.tensor([0.25, 0.5]))),
        "aten::quantile.scalar": S(((16,),), lambda a: (a, 0.5)),
        "aten::nanquantile": S(((16,),), lambda a: (a, torch.tensor([0.25, 0.5]))),
        "aten::nanquantile.scalar": S(((16,),), lambda a: (a, 0.5)),
        "aten::adaptive_avg_pool3d": S(((1, 2, 4, 4, 4),), lambda a: (a, [2, 2, 2])),
        "aten::adaptive_max_pool3d": S(((1, 2, 4, 4, 4),), lambda a: (a, [2, 2, 2])),
        "aten::avg_pool3d": S(((1, 2, 4, 4, 4),), lambda a: (a, [2, 2, 2])),
        "aten::max_pool3d": S(((1, 2, 4, 4, 4),), lambda a: (a, [2, 2, 2])),
        "aten::fractional_max_pool2d": S(((1, 2, 6, 6), (1, 2, 2)), lambda a, r: (a, [2, 2], [3, 3], r.sigmoid())),
        "aten::fractional_max_pool3d": S(((1, 1, 6, 6, 6), (1, 1, 3)),
                                         lambda a, r: (a, [2, 2, 2], [3, 3, 3], r.sigmoid())),
        "aten::max_unpool2d": S(((1, 1, 2, 2),), lambda a: (a, long(0, 3, 8, 15).reshape(1, 1, 2, 2), [4, 4])),
        "aten::max_unpool3d": S(((1, 1, 1, 1, 2),), lambda a: (a, long(0, 7).reshape(1, 1, 1, 1, 2), [2, 2, 2],
                                                               [2, 2, 2], [0, 0, 0])),
        "aten::reflection_pad1d": S(((1, 2, 5),), lambda a: (a, [2, 2])),
        "aten::reflection_pad2d": S((image,), lambda a: (a, [1, 1, 1, 1])),
        "aten::replication_pad1d": S(((1, 2, 5),), lambda a: (a, [2, 2])),
        "aten::replication_pad2d": S((image,), lambda a: (a, [1, 1, 1, 1])),
        "aten::replication_pad3d": S((volume,), lambda a: (a, [1, 1, 1, 1, 1, 1])),
        "aten::upsample_nearest1d": S(((1, 2, 4),), lambda a: (a, [7])),
        "aten::upsample_nearest2d": S((image,), lambda a: (a, [7, 7])),
        "aten::upsample_nearest3d": S((volume,), lambda a: (a, [5, 5, 5])),
        "aten::_upsample_nearest_exact1d": S(((1, 2, 4),), lambda a: (a, [7])),
        "aten::_upsample_nearest_exact2d": S((image,), lambda a: (a, [7, 7])),
        "aten::_upsample_nearest_exact3d": S((volume,), lambda a: (a, [5, 5, 5])),
        "aten::upsample_linear1d": S(((1, 2, 4),), lambda a: (a, [7], False)),
        "aten::upsample_bilinear2d": S((image,), lambda a: (a, [7, 7], False)),
        "aten::upsample_bicubic2d": S((image,), lambda a: (a, [7, 7], False)),
        "aten::upsample_trilinear3d": S((volume,), lambda a: (a, [5, 5, 5], False)),
        "aten::_upsample_bilinear2d_aa": S((image,), lambda a: (a, [3, 3], False)),
        "aten::_upsample_bicubic2d_aa": S((image,), lambda a: (a, [3, 3], False)),
        "aten::grid_sampler_2d": S((image, (1, 3, 3, 2)), grid2),
        "aten::_grid_sampler_2d_cpu_fallback": S((image, (1, 3, 3, 2)), grid2),
        "aten::grid_sampler_3d": S((volume, (1, 2, 2, 2, 3)), grid2),
        "aten::stft": S(((64,),), lambda a: (a, 16, None, None, None, False, None, True)),
        "aten::stft.center": S(((64,),), lambda a: (a, 16, None, None, None, True, "reflect", False, None, True)),
        # -- ops autocast runs in float32: linear algebra and FFTs (no CPU kernel in the low formats) --
        "aten::_lu_with_info": S(((4, 4),), lambda a: (well(a),)),
        "aten::cholesky": S(((4, 4),), lambda a: (spd(a),)),
        "aten::cholesky_inverse": S(((4, 4),), lambda a: (lower(a),)),
        "aten::cholesky_solve": S(((4, 2), (4, 4)), lambda b, a: (b, lower(a))),
        "aten::geqrf": S(((4, 4),)),
        "aten::inverse": S(((4, 4),), lambda a: (well(a),)),
        "aten::linalg_inv": S(((4, 4),), lambda a: (well(a),)),
        "aten::linalg_inv_ex": S(((4, 4),), lambda a: (well(a),)),
        "aten::linalg_cholesky": S(((4, 4),), lambda a: (spd(a),)),
        "aten::linalg_cholesky_ex": S(((4, 4),), lambda a: (spd(a),)),
        "aten::linalg_cond": S(((4, 4),), lambda a: (well(a),)),
        "aten::linalg_cond.p_str": S(((4, 4),), lambda a: (well(a), "fro")),
        "aten::linalg_eig": S(((4, 4),)),
        "aten::linalg_eigvals": S(((4, 4),)),
        "aten::linalg_eigh": S(((4, 4),), lambda a: (a + a.T,)),
        "aten::linalg_eigvalsh": S(((4, 4),), lambda a: (a + a.T,)),
        "aten::linalg_householder_product": S(((4, 3), (3,))),
        "aten::orgqr": S(((4, 3), (3,))),
        "aten::ormqr": S(((4, 3), (3,), (4, 2))),
        "aten::linalg_lstsq": S(((5, 3), (5, 2))),
        "aten::linalg_matrix_rank": S(((4, 4),), lambda a: (a, 1e-3)),
        "aten::linalg_matrix_rank.atol_rtol_float": S(((4, 4),)),
        "aten::linalg_matrix_rank.atol_rtol_tensor": S(((4, 4),)),
        "aten::linalg_matrix_rank.tol_tensor": S(((4, 4),), lambda a: (a, torch.tensor(1e-3))),
        "aten::linalg_qr": S(((4, 4),)),
        "aten::qr": S(((4, 4),)),
        "aten::linalg_solve": S(((4, 4), (4, 2)), lambda a, b: (well(a), b)),
        "aten::linalg_svd": S(((4, 4),)),
        "aten::linalg_svdvals": S(((4, 4),)),
        "aten::svd": S(((4, 4),)),
        "aten::pinverse": S(((4, 4),)),
        "aten::linalg_tensorinv": S(((4, 4),), lambda a: (well(a), 1)),
        "aten::linalg_tensorsolve": S(((6, 6), (2, 3)), lambda a, b: (well(a).reshape(2, 3, 6), b)),
        "aten::lu_solve": S(((4, 2), (4, 4)), lambda b, a: (b, *torch.linalg.lu_factor(well(a)))),
        "aten::triangular_solve": S(((4, 2), (4, 4)), lambda b, a: (b, lower(a).T)),
        "aten::fft_fft": S(((16,),)),
        "aten::fft_ifft": S(((16,),)),
        "aten::fft_rfft": S(((16,),)),
        "aten::fft_irfft": S(((16,),)),
        "aten::fft_hfft": S(((16,),)),
        "aten::fft_ihfft": S(((16,),)),
        "aten::fft_fft2": S(((4, 4),)),
        "aten::fft_ifft2": S(((4, 4),)),
        "aten::fft_rfft2": S(((4, 4),)),
        "aten::fft_irfft2": S(((4, 4),)),
        "aten::fft_fftn": S(((4, 4),)),
        "aten::fft_ifftn": S(((4, 4),)),
        "aten::fft_rfftn": S(((4, 4),)),
        "aten::fft_irfftn": S(((4, 4),)),
    }


def samples() -> dict:
    """``{op name: Sample}`` (imports torch)."""
    import torch
    return _samples(torch)


def arguments(sample: Sample, low, seed: int = 0) -> tuple:
    """(float32 arguments, the same values in ``low``) of a sample: floating arguments rounded to
    ``low`` and widened back, so both hold the same values."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=generator) for shape in sample.shapes]
    built = tuple(sample.build(*tensors)) if sample.build else tuple(tensors)

    def to(dtype):
        def cast(value):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(low).to(dtype)
            if isinstance(value, (list, tuple)):
                return type(value)(cast(item) for item in value)
            return value
        return cast
    return to(torch.float32)(built), to(low)(built)
