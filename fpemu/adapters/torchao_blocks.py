"""torchao 0.18's block quantization (MX ``to_mx`` / ``to_dtype``, NVFP4), driven on the CPU.

:func:`torchao_block_quantize` runs the real torchao code for one of fpemu's torchao scale rules and
returns its scale codes, element codes and dequantized values as a
:class:`~fpemu.blocks.BlockQuantized`, so the differential tests compare them bit for bit with
:func:`fpemu.block_quantize`.  torch and torchao are imported on first use.
"""

from __future__ import annotations

import numpy as np

from fpemu.blocks import SCALE_RULES, BlockQuantized
from fpemu.errors import FpemuInputError
from fpemu.formats import get_format, unpack_nibbles

# fpemu's rule -> torchao's ScaleCalculationMode name (MX) or the NVFP4 levels.
_MX_MODES = {"torchao_floor": "FLOOR", "torchao_ceil": "CEIL", "torchao_even": "EVEN", "torchao_rceil": "RCEIL"}
_NVFP4 = ("torchao_nvfp4", "torchao_nvfp4_2level")
DRIVEN_RULES = (*_MX_MODES, *_NVFP4)  # the SCALE_RULES rows torchao_block_quantize runs (reports/recipes/ reads it)


def torchao_block_quantize(x, element_format: str, scale_rule: str, device: str = "cpu") -> BlockQuantized:
    """torchao's own result for ``block_quantize(x, element_format, scale_rule=scale_rule)`` (blocks
    along the last axis, the rule's block size; x float32 with a last axis of whole blocks; NVFP4
    takes 2-D x), computed on ``device`` (``"cpu"`` or ``"cuda"``: torchao's eager code on CUDA tensors;
    bit for bit against fpemu on the CPU only so far: no GPU has run it).  Two-level NVFP4 of more than
    32,768 values holding a NaN depends on torch's thread count (the tensor amax's NaN bits): its model
    is ``block_quantize(..., torch_threads=torch.get_num_threads())``.

    Example:
      >>> import numpy as np
      >>> q = torchao_block_quantize(np.ones((1, 32), np.float32), "fp8_e4m3fn", "torchao_floor")
      >>> int(q.scale_codes[0, 0]), float(q.values[0, 0])
      (119, 1.0)
    """
    if scale_rule not in DRIVEN_RULES:
        raise FpemuInputError(f"scale_rule: torchao drives {', '.join(DRIVEN_RULES)}, got {scale_rule!r}")
    rule = SCALE_RULES[scale_rule]
    elem = get_format(element_format)
    data = np.ascontiguousarray(x, dtype=np.float32)
    run = _nvfp4 if scale_rule in _NVFP4 else _mx
    scale_codes, element_codes, values, tensor_scale = run(data, elem, rule, device)
    return BlockQuantized(rule.name, elem, get_format(rule.scale_format), rule.block_size, data.ndim - 1,
                          scale_codes, get_scales(scale_codes, rule), element_codes, values, tensor_scale)


def get_scales(scale_codes: np.ndarray, rule) -> np.ndarray:
    import torch
    if rule.scale_format == "e8m0":
        from torchao.prototype.mx_formats.mx_tensor import get_fp_scale
        return get_fp_scale(torch.from_numpy(scale_codes).view(torch.float8_e8m0fnu)).numpy()
    return torch.from_numpy(scale_codes).view(torch.float8_e4m3fn).float().numpy()


def _torch_element_dtype(elem):
    import torch
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    return {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp6_e2m3fn": DTYPE_FP6_E2M3,
            "fp6_e3m2fn": DTYPE_FP6_E3M2, "fp4_e2m1fn": torch.float4_e2m1fn_x2}[elem.name]


def _codes(data_lp, elem) -> np.ndarray:
    import torch
    codes = data_lp.view(torch.uint8).cpu().numpy()
    return unpack_nibbles(codes) if elem.bits == 4 else codes


def _mx(data: np.ndarray, elem, rule, device: str):
    import torch
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    dtype = _torch_element_dtype(elem)
    mode = getattr(ScaleCalculationMode, _MX_MODES[rule.name])
    scale, data_lp = to_mx(torch.from_numpy(data).to(device), dtype, rule.block_size, mode)
    values = to_dtype(data_lp, scale, dtype, rule.block_size, torch.float32).cpu().numpy()
    return scale.view(torch.uint8).cpu().numpy(), _codes(data_lp, elem), values, None


def _nvfp4(data: np.ndarray, elem, rule, device: str):
    import torch
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    tensor = torch.from_numpy(data).to(device)
    tensor_scale = per_tensor_amax_to_scale(tensor.abs().max()) if rule.levels == 2 else None
    quantized = NVFP4Tensor.to_nvfp4(tensor, rule.block_size, per_tensor_scale=tensor_scale)
    values = quantized.dequantize(torch.float32).cpu().numpy()
    scale_codes = quantized.scale.view(torch.uint8).cpu().numpy().reshape(*data.shape[:-1], -1)
    return (scale_codes, _codes(quantized.qdata, elem).reshape(data.shape), values,
            None if tensor_scale is None else float(tensor_scale))
