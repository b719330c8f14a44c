"""Transformer Engine's Python block-scaling references (NVFP4, MXFP8), run on the CPU from its source.

TE's NVFP4 reference quantizer, ``NVFP4QuantizerRef`` (``pytorch/custom_recipes/reference_nvfp4.py``),
is pure torch, but its module cannot be imported without TE's compiled extension: it imports
``transformer_engine.pytorch.quantized_tensor`` (for the base classes ``Quantizer`` and
``QuantizedTensorStorage``) and ``custom_recipes.gemm``; importing either runs
``transformer_engine/pytorch/__init__.py``, which loads the extension
(``load_framework_extension("torch")``), and ``quantized_tensor`` itself does ``import
transformer_engine_torch as tex`` (used by ``Quantizer.make_empty`` only:
``tex.create_empty_quantized_tensor``).  The quantization path (``_quantize`` ->
``_quantize_blockwise_reference`` -> ``cast_to_fp4x2``) uses no symbol of either: it reads only the
attributes ``NVFP4QuantizerRef.__init__`` and ``Quantizer.__init__`` set.  So, as
:mod:`fpemu.adapters.te_recipes` does, the functions are taken unchanged from the file (by name, with
``ast``) and run with torch, ``self`` being a plain holder of those attributes (the ``__init__``s
call ``super()``, which needs the real classes).  TE's MXFP8 reference,
``_mxfp8_2d_quantize_reference`` (``tests/pytorch/test_mxfp8_2d_quantize.py``, pure torch; the test
module imports ``transformer_engine.pytorch``), is driven the same way.  Nothing of TE's arithmetic
is reimplemented here.

The source: as :mod:`fpemu.adapters.te_recipes` (``FPEMU_TE_SOURCE``, a checkout or git mirror
holding commit ``d0067d0``; by default ``~/.cache/fpemu/TransformerEngine``, which then needs the two
files :data:`REFERENCE_FILES`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import sys
import types

import numpy as np

from fpemu.adapters.te_recipes import TE_COMMIT, _functions, _read, _source_root, te_source_versions, unreadable
from fpemu.blocks import SCALE_RULES, BlockQuantized
from fpemu.errors import FpemuInputError
from fpemu.formats import get_format, unpack_nibbles
from fpemu.formats.rounding import decode

_NVFP4_REFERENCE = "transformer_engine/pytorch/custom_recipes/reference_nvfp4.py"
_MXFP8_REFERENCE = "tests/pytorch/test_mxfp8_2d_quantize.py"
REFERENCE_FILES = (_NVFP4_REFERENCE, _MXFP8_REFERENCE)
# sha256 (first 16 hex digits) of each file at TE_COMMIT.
_PINNED = {_NVFP4_REFERENCE: "9213bd1effe9ecff", _MXFP8_REFERENCE: "ce2e34e8b8473ad7"}
DRIVEN_RULES = ("te_nvfp4_reference", "te_mxfp8_reference")  # the SCALE_RULES rows te_block_quantize runs
# NVFP4QuantizerRef's methods on the quantization path (staticmethods stay staticmethods).
_NVFP4_METHODS = ("_quantize", "_quantize_blockwise_reference", "_pad_tensor", "_rm_pad_tensor")


def te_reference_unavailable():
    """Why TE's reference files cannot be read here (None when they can)."""
    if unreadable(REFERENCE_FILES):
        return (f"no TransformerEngine reference source ({', '.join(REFERENCE_FILES)}) at {_source_root()} "
                f"(set FPEMU_TE_SOURCE to a checkout or git mirror holding commit {TE_COMMIT[:7]})")
    return None


def te_reference_versions() -> dict:
    """The TE reference source driven (the pinned commit, or "modified")."""
    return te_source_versions(_PINNED)


def te_block_quantize(x, element_format: str, scale_rule: str, device: str = "cpu") -> BlockQuantized:
    """TE's own result for ``block_quantize(x, element_format, scale_rule=scale_rule)``, the blocks
    adapter ``te_block_reference`` (fpemu.adapters.ADAPTERS): ``te_nvfp4_reference`` runs
    :func:`te_nvfp4_reference` (1 x 16 tiles), ``te_mxfp8_reference`` :func:`te_mxfp8_reference`, on
    ``device``'s tensors (checked against fpemu on the CPU only so far: no GPU has run them).

    Example:
      >>> q = te_block_quantize(np.ones((1, 32), np.float32), "fp8_e4m3fn", "te_mxfp8_reference")  # doctest: +SKIP
      >>> int(q.scale_codes[0, 0])                                        # 1 / 448 rounded up: 2**-8
      119
    """
    if scale_rule not in DRIVEN_RULES:
        raise FpemuInputError(f"scale_rule: TE's references drive {', '.join(DRIVEN_RULES)}, got {scale_rule!r}")
    if get_format(element_format).name not in SCALE_RULES[scale_rule].elements:
        raise FpemuInputError(f"element_format: {scale_rule} takes {', '.join(SCALE_RULES[scale_rule].elements)}, "
                              f"got {element_format!r}")
    if scale_rule == "te_nvfp4_reference":
        return te_nvfp4_reference(x, device=device)[0]
    return te_mxfp8_reference(x, device)


@functools.lru_cache(maxsize=None)
def _nvfp4_reference() -> dict:
    import typing
    import torch
    namespace = {"torch": torch, "Tuple": typing.Tuple, "Optional": typing.Optional}
    _functions(_NVFP4_REFERENCE, ("cast_to_fp4x2",), namespace)
    return _functions(_NVFP4_REFERENCE, _NVFP4_METHODS, namespace, within="NVFP4QuantizerRef")


def _nvfp4_holder(functions: dict, tile: tuple):
    """``self`` for the methods: the attributes NVFP4QuantizerRef.__init__ (and Quantizer.__init__) set
    for ``NVFP4QuantizerRef(Fp4Formats.E2M1, rowwise=True, columnwise=False, quant_tile_shape=tile)``
    (no RHT)."""
    holder = types.SimpleNamespace(
        rowwise_usage=True, columnwise_usage=False, internal=True, optimize_for_gemm=False, pow_2_scales=False,
        eps=0.0, quant_tile_shape=tile, row_scaled_nvfp4=False, nvfp4_use_4over6=False, nvfp4_e4m3_max=448,
        nvfp4_4over6_err_mode="MAE", nvfp4_4over6_err_use_fast_math=False, with_rht=False,
        with_random_sign_mask=True)
    holder._pad_tensor, holder._rm_pad_tensor = functions["_pad_tensor"], functions["_rm_pad_tensor"]
    holder._quantize_blockwise_reference = (  # a classmethod: cls is the holder
        lambda *args, **kwargs: functions["_quantize_blockwise_reference"](holder, *args, **kwargs))
    return holder


def _as_first_rows(data: np.ndarray, band: int) -> np.ndarray:
    """Each row of ``data`` as the first row of a band of ``band`` rows, the others 0: in square tiles
    of ``band``, a tile's amax is then its 1-D block's (read the results back with ``[::band]``)."""
    tiles = np.zeros((data.shape[0] * band, data.shape[1]), np.float32)
    tiles[::band] = data
    return tiles


def te_nvfp4_reference(x, tile_rows: int = 1, device: str = "cpu") -> tuple:
    """``NVFP4QuantizerRef._quantize`` (rowwise, no RHT) on 2-D float32 ``x`` of 1 x 16 blocks, with
    TE's 1 x 16 tiles (``tile_rows=1``) or its 16 x 16 tiles (``tile_rows=16``: each row of ``x`` the
    first row of a band of tiles whose other rows are 0, so each tile's amax is its block's).

    Returns:
      (a :class:`~fpemu.blocks.BlockQuantized` of TE's scale codes and element codes, whose values
      are TE's dequantize-kernel formula fl32(e * fl32(fl32(s * amax) * fl32(1 / 2688))) applied to
      them (the reference returns no values) and whose tensor_scale is the reference's own
      global_decode_scale (1 / S_enc, read from its frame), and the reference's global amax as a float32).

    Example:
      >>> q, amax = te_nvfp4_reference(np.full((1, 16), 3.0, np.float32))  # doctest: +SKIP
      >>> int(q.scale_codes[0, 0]), int(q.element_codes[0, 0]), float(amax)  # 448 and 6.0
      (126, 7, 3.0)
    """
    import torch
    if tile_rows not in (1, 16):
        raise ValueError(f"tile_rows: TE's NVFP4 tiles are 1 x 16 or 16 x 16, got {tile_rows!r}")
    functions = _nvfp4_reference()
    data = _as_first_rows(np.ascontiguousarray(x, dtype=np.float32), tile_rows)
    with _local_on_return(functions["_quantize_blockwise_reference"], "global_decode_scale") as decode_scale:
        qx, sx, _, _, global_amax, _ = functions["_quantize"](_nvfp4_holder(functions, (tile_rows, 16)),
                                                             torch.from_numpy(data).to(device))
    qx, sx, global_amax = qx.cpu(), sx.cpu(), global_amax.cpu()
    rule, elem = SCALE_RULES["te_nvfp4_reference"], get_format("fp4_e2m1fn")
    scales = sx.float().numpy()[::tile_rows].copy()
    amax = np.float32(global_amax.item())
    element_codes = unpack_nibbles(qx.numpy())[::tile_rows].copy()
    with np.errstate(invalid="ignore", over="ignore"):
        dequantize = (scales * amax) * (np.float32(1.0) / np.float32(448 * 6))
        values = decode(element_codes, elem, dtype=np.float32) * np.repeat(dequantize, rule.block_size, axis=-1)
    scale_codes = sx.contiguous().view(torch.uint8).numpy()[::tile_rows].copy()
    return (BlockQuantized(rule.name, elem, get_format(rule.scale_format), rule.block_size, 1, scale_codes, scales,
                           element_codes, values, float(decode_scale[0].item())), amax)


@contextlib.contextmanager
def _local_on_return(function, name: str):
    """A list that gets ``function``'s local ``name`` each time it returns inside the block: the value
    TE's own code computed (the reference keeps its tensor scale, global_decode_scale, to itself)."""
    seen, code, previous = [], function.__code__, sys.getprofile()

    def profile(frame, event, arg):
        if event == "return" and frame.f_code is code:
            seen.append(frame.f_locals[name])

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


@functools.lru_cache(maxsize=None)
def _mxfp8_reference() -> dict:
    import torch
    return _functions(_MXFP8_REFERENCE, ("_float_to_e8m0", "_e8m0_to_scale_inv", "_mxfp8_2d_quantize_reference"),
                      {"torch": torch, **_constants(_MXFP8_REFERENCE, ("FP8_E4M3_MAX", "MXFP8_BLOCK_SIZE"))})


def _constants(path: str, names) -> dict:
    """The module-level constants ``names`` of TE's file ``path`` (literal assignments)."""
    tree = ast.parse(_read(path), filename=path)
    found = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
             if isinstance(node, ast.Assign) and len(node.targets) == 1
             and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names}
    if set(found) != set(names):
        raise AttributeError(f"{path} at {TE_COMMIT[:7]} has no constant {', '.join(sorted(set(names) - set(found)))}")
    return found


def te_mxfp8_reference(x, device: str = "cpu") -> BlockQuantized:
    """TE's ``_mxfp8_2d_quantize_reference`` on 2-D float32 ``x`` of 1 x 32 blocks: each row of blocks
    becomes the first row of a band of 32 x 32 tiles whose other rows are 0, so a tile's amax is its
    block's; TE's scale codes and e4m3 codes of those rows, values fpemu's e8m0 dequantize of them.

    Example:
      >>> q = te_mxfp8_reference(np.full((1, 32), 448.0, np.float32))  # doctest: +SKIP
      >>> int(q.scale_codes[0, 0]), int(q.element_codes[0, 0])
      (127, 126)
    """
    import torch
    data = np.ascontiguousarray(x, dtype=np.float32)
    rule, elem = SCALE_RULES["te_mxfp8_reference"], get_format("fp8_e4m3fn")
    block = rule.block_size
    codes, row_scales, _ = _mxfp8_reference()["_mxfp8_2d_quantize_reference"](
        torch.from_numpy(_as_first_rows(data, block)).to(device))
    element_codes = codes.view(torch.uint8).cpu().numpy()[::block].copy()
    scale_codes = row_scales.cpu().numpy()[::block].copy()
    with np.errstate(invalid="ignore", over="ignore"):
        scales = np.where(scale_codes == 255, np.float32(np.nan),
                          np.ldexp(np.float32(1), scale_codes.astype(np.int32) - 127))
        values = decode(element_codes, elem, dtype=np.float32) * np.repeat(scales, block, axis=-1)
    return BlockQuantized(rule.name, elem, get_format("e8m0"), block, 1, scale_codes, scales, element_codes, values)
