"""``accumulation="low"``: the ops that accumulate, computed with their running sum rounded to the low format.

A GPU kernel that accumulates in the low format adds its terms in blocks and rounds the running sum
after each.  The model here: the reduced terms in order, in blocks of ``block`` terms, each block
summed in float32 and added to the running sum, which is rounded (``round_sum``) after every block:

* matrix products (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``addmv``, ``mv``, ``dot``, ``addbmm``):
  blocks of the inner dimension (addbmm: of the batch's inner dimensions one batch after the other);
  the bias of the add* forms is added to the rounded total and rounded again;
* ``sum`` and ``mean`` over any dims: the reduced elements in row-major order of the reduced dims;
  ``mean`` divides the rounded total by the count and rounds once more;
* ``convolution`` (any groups, transposed or not): blocks of ``block`` input channels of each group
  (a channel's kernel taps summed in float32 within its block);
* ``convolution_backward``: the input gradient in blocks of output channels, the weight gradient in
  blocks of ``block`` samples of the batch (each sample's positions summed in float32), the bias
  gradient as a ``sum`` of the output gradient over the batch and positions.

Every other op that may accumulate (any op that is not modelled, not tagged pointwise by torch and
not data movement or a selection, ``NON_ACCUMULATING``: softmax, normalizations, losses, cumulative
sums, factorizations, FFTs, interpolations, ...) is refused under ``accumulation="low"``, naming
it: it would otherwise accumulate in float32 silently.
"""

from __future__ import annotations

import torch

from fpemu.errors import FpemuInputError

# Ops that do not accumulate, beside those torch tags pointwise: data movement, selections (max,
# sort, max pooling) and factories.  An op in none of the three is refused under accumulation="low":
# it might accumulate, and would then do so in float32 silently.
NON_ACCUMULATING = frozenset({
    "aten::_to_copy", "aten::clone", "aten::copy_", "aten::_unsafe_view", "aten::cat", "aten::stack",
    "aten::unsafe_split", "aten::unsafe_chunk", "aten::split_with_sizes_copy", "aten::constant_pad_nd",
    "aten::reflection_pad1d", "aten::reflection_pad2d", "aten::reflection_pad3d", "aten::replication_pad1d",
    "aten::replication_pad2d", "aten::replication_pad3d", "aten::empty_like", "aten::zeros_like", "aten::ones_like",
    "aten::full_like", "aten::fill_", "aten::zero_", "aten::masked_fill_", "aten::index_select", "aten::index",
    "aten::index_copy", "aten::gather", "aten::scatter", "aten::embedding", "aten::triu", "aten::tril", "aten::flip",
    "aten::roll", "aten::repeat", "aten::sort", "aten::topk", "aten::max", "aten::min", "aten::amax", "aten::amin",
    "aten::argmax", "aten::argmin", "aten::max_pool2d_with_indices", "aten::max_pool3d_with_indices",
    "aten::max_pool2d_with_indices_backward", "aten::adaptive_max_pool2d", "aten::adaptive_max_pool3d",
    "aten::fractional_max_pool2d", "aten::fractional_max_pool3d", "aten::max_unpool2d", "aten::max_unpool3d",
    "aten::upsample_nearest1d", "aten::upsample_nearest2d", "aten::upsample_nearest3d",
    "aten::_upsample_nearest_exact1d", "aten::_upsample_nearest_exact2d", "aten::_upsample_nearest_exact3d",
    "aten::_prelu_kernel", "aten::nll_loss_backward", "aten::nll_loss2d_backward", "aten::linalg_cross",
    "aten::fake_quantize_per_tensor_affine_cachemask", "aten::polar", "aten::native_dropout",
    "aten::native_dropout_backward", "aten::bernoulli_", "aten::uniform_", "aten::normal_",
})


def _accumulates(func, packet: str) -> bool:
    return not (packet in NON_ACCUMULATING or torch.Tag.pointwise in func.tags or torch.Tag.inplace_view in func.tags)


def _running_sum(parts, round_sum):
    """The parts (float32 block sums) added in order to a running sum rounded after each."""
    total = None
    for part in parts:
        total = round_sum(part if total is None else total + part)
    return total


def _blocks(length: int, block: int):
    return ((start, min(start + block, length)) for start in range(0, length, block))


def _product(a, b, block, round_sum):
    """a @ b (matrices, batches, vectors: torch.matmul's forms) over blocks of the inner dimension."""
    def part(start, stop):
        return torch.matmul(a[..., start:stop], b[start:stop] if b.dim() == 1 else b[..., start:stop, :])
    if not a.shape[-1]:  # an empty inner dimension: zeros
        return round_sum(torch.matmul(a, b))
    return _running_sum((part(*span) for span in _blocks(a.shape[-1], block)), round_sum)


def _batched_product(bias, batch1, batch2, block, round_sum):
    """addbmm: bias + the sum over the batch of batch1[i] @ batch2[i], whose terms are the batch's
    inner dimensions one after the other (batch by batch)."""
    a = batch1.permute(1, 0, 2).reshape(batch1.shape[1], -1)
    b = batch2.reshape(-1, batch2.shape[2])
    return round_sum(_product(a, b, block, round_sum) + bias)


def _reduced(x, dims, keepdim: bool, block: int, round_sum):
    """The sum of x over ``dims`` (None or empty: all), its elements in row-major order of the dims."""
    if x.dim() == 0:
        return round_sum(x.clone())
    reduced = sorted({d % x.dim() for d in dims} if dims else range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in reduced]
    flat = x.permute(kept + reduced).reshape([x.shape[d] for d in kept] + [-1])
    total = _running_sum((flat[..., start:stop].sum(-1) for start, stop in _blocks(flat.shape[-1], block)),
                         round_sum)
    if total is None:  # an empty reduction
        total = round_sum(flat.sum(-1))
    if keepdim:
        total = total.reshape([1 if d in reduced else x.shape[d] for d in range(x.dim())])
    return total


def _count(x, dims) -> int:
    count = 1
    for d in (range(x.dim()) if not dims else dims):
        count *= x.shape[d]
    return count


def _group_channels(channels: int, groups: int, start: int, stop: int):
    """Indices of channels start:stop of every group (channels of a tensor split into ``groups``)."""
    per_group = channels // groups
    return torch.tensor([g * per_group + c for g in range(groups) for c in range(start, stop)])


def _convolution(args, block, round_sum):
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
    # the input channels reduced: a plain weight is (out, in/groups, ...), a transposed one (in, out/groups, ...)
    per_group = x.shape[1] // groups

    def part(start, stop):
        channels = _group_channels(x.shape[1], groups, start, stop)
        w = weight.index_select(0, channels) if transposed else weight[:, start:stop]
        return torch.ops.aten.convolution(x.index_select(1, channels), w, None, stride, padding, dilation,
                                          transposed, output_padding, groups)
    total = _running_sum((part(*span) for span in _blocks(per_group, block)), round_sum)
    if bias is None:
        return total
    return round_sum(total + bias.reshape([1, -1] + [1] * (total.dim() - 2)))


def _convolution_backward(args, block, round_sum):
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    common = (stride, padding, dilation, transposed, output_padding, groups)
    grad_input = grad_weight = grad_bias = None
    if mask[0]:
        # the output channels reduced: dim 0 of a plain weight, dim 1 of a transposed one
        per_group = grad.shape[1] // groups

        def input_part(start, stop):
            channels = _group_channels(grad.shape[1], groups, start, stop)
            w = weight[:, start:stop] if transposed else weight.index_select(0, channels)
            return torch.ops.aten.convolution_backward(grad.index_select(1, channels), x, w, None, *common,
                                                       [True, False, False])[0]
        grad_input = _running_sum((input_part(*span) for span in _blocks(per_group, block)), round_sum)
    if mask[1]:
        def weight_part(start, stop):
            return torch.ops.aten.convolution_backward(grad[start:stop], x[start:stop], weight, None, *common,
                                                       [False, True, False])[1]
        grad_weight = _running_sum((weight_part(*span) for span in _blocks(grad.shape[0], block)), round_sum)
    if mask[2]:
        grad_bias = _reduced(grad, [0] + list(range(2, grad.dim())), False, block, round_sum)
    return grad_input, grad_weight, grad_bias


# Per op: (bias position or None, the two operand positions) of the matrix products.
_PRODUCTS = {"aten::mm": (None, 0, 1), "aten::bmm": (None, 0, 1), "aten::mv": (None, 0, 1), "aten::dot": (None, 0, 1),
             "aten::addmm": (0, 1, 2), "aten::baddbmm": (0, 1, 2), "aten::addmv": (0, 1, 2)}
_REDUCTIONS = ("aten::sum", "aten::sum.dim_IntList", "aten::mean", "aten::mean.dim")
MODELLED = frozenset(_PRODUCTS) | frozenset(_REDUCTIONS) | {"aten::addbmm", "aten::convolution",
                                                              "aten::convolution_backward"}


# What a model can do instead, for the refused ops models use most.
_ATTENTION = ("compute attention with explicit matrix products and softmax (transformers: "
              "attn_implementation='eager'), or use accumulation='fp32'")
_ALTERNATIVES = {"aten::_scaled_dot_product_flash_attention_for_cpu": _ATTENTION,
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _ATTENTION}


def _refuse(name: str, why: str):
    raise FpemuInputError(f"accumulation='low' cannot model {name}: {why}; "
                          + _ALTERNATIVES.get(name, "use accumulation='fp32'"))


def low_accumulated(func, name: str, packet: str, args, kwargs, block: int, round_sum):
    """The op ``func`` (``name``, an overload of ``packet``) on float32 ``args`` with its running sum
    rounded by ``round_sum`` after every ``block`` terms; None if the op does not accumulate.

    Raises:
      FpemuInputError: an op that may accumulate but is not modelled (not in ``MODELLED``, not
        pointwise, not in ``NON_ACCUMULATING``), or a modelled one called with arguments the model
        does not take (alpha, beta, out=, ...).

    Example:
      >>> ones = torch.ones(1, 512)
      >>> bf16 = lambda v: v.bfloat16().float()
      >>> low_accumulated(torch.ops.aten.mm.default, "aten::mm", "aten::mm", (ones, ones.T), {}, 1, bf16).item()
      256.0
    """
    if name not in MODELLED:
        if not _accumulates(func, packet):
            return None
        _refuse(name, "it is neither pointwise nor data movement, so it may accumulate, and fpemu models the "
                "low-precision accumulation of " + ", ".join(sorted(MODELLED)) + " only")
    extra = {key: value for key, value in kwargs.items()
             if not (key == "dtype" and value in (None, torch.float32))
             and not (key in ("alpha", "beta") and value == 1)}
    if extra:
        _refuse(name, f"the model takes no {', '.join(sorted(extra))} argument (got {extra})")
    if name in _PRODUCTS:
        bias_at, a_at, b_at = _PRODUCTS[name]
        total = _product(args[a_at], args[b_at], block, round_sum)
        return total if bias_at is None else round_sum(total + args[bias_at])
    if name in _REDUCTIONS:
        x, dims = args[0], (args[1] if len(args) > 1 else None)
        keepdim = len(args) > 2 and args[2]
        total = _reduced(x, dims, keepdim, block, round_sum)
        return round_sum(total / _count(x, dims)) if packet == "aten::mean" else total
    if name == "aten::addbmm":
        return _batched_product(*args[:3], block, round_sum)
    if name == "aten::convolution":
        return _convolution(args, block, round_sum)
    return _convolution_backward(args, block, round_sum)
