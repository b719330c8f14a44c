"""Two 4-bit codes per byte, in the order torchao and PyTorch's ``float4_e2m1fn_x2`` use.

torchao 0.18's ``pack_uint4`` (``torchao/prototype/mx_formats/kernels.py``) puts element ``2i`` in
the low nibble of byte ``i`` and element ``2i + 1`` in the high nibble (``data[::2] | data[1::2] << 4``),
along the last axis; ``unpack_uint4`` reads them back in that order.
"""

from __future__ import annotations

import numpy as np


def pack_nibbles(codes) -> np.ndarray:
    """Pack 4-bit codes two per byte along the last axis, the first of each pair in the low nibble.

    Args:
      codes: integer array of codes 0..15 whose last axis has even length.

    Returns:
      A uint8 array whose last axis is half as long.

    Example:
      >>> pack_nibbles([0x1, 0xA, 0xF, 0x0]).tolist()
      [161, 15]
    """
    codes = np.asarray(codes)
    if codes.dtype.kind not in "iu":
        raise TypeError(f"codes must be an integer array, got dtype {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: the last axis must have even length to pack two per byte, got shape {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() > 0xF):
        raise ValueError(f"codes must be 4-bit codes (0 .. 15), got values in [{codes.min()}, {codes.max()}]")
    codes = codes.astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))


def unpack_nibbles(packed) -> np.ndarray:
    """The 4-bit codes of :func:`pack_nibbles`' bytes, low nibble first (the last axis doubles).

    Example:
      >>> unpack_nibbles([161, 15]).tolist()
      [1, 10, 15, 0]
    """
    packed = np.asarray(packed)
    if packed.dtype.kind not in "iu" or (packed.size and (packed.min() < 0 or packed.max() > 0xFF)):
        raise TypeError(f"packed must be an array of bytes (0 .. 255), got dtype {packed.dtype}")
    packed = packed.astype(np.uint8)
    pairs = np.stack([packed & np.uint8(0xF), packed >> np.uint8(4)], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2) if packed.ndim else pairs
