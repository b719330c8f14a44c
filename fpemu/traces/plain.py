"""Golden files of plain data: dicts, lists, numbers, strings and numpy arrays, stored losslessly.

A value is encoded into JSON that keeps every bit: a float as its 64-bit pattern (so NaN payloads,
the sign of NaN and of zero survive) beside a readable repr, an array as its dtype, shape and
raw little-endian bytes in hex beside its first values.  Two values are the same golden when
their encodings are equal: bit for bit, NaN-aware (a NaN equals the same NaN pattern).
:func:`data_differences` lists what differs, path by path, for a failing test.

Example:
  >>> import numpy as np
  >>> encode_data({"loss": 0.5, "w": np.array([1.0, -0.0], np.float32)})["loss"]
  {'float': '0.5', 'bits': '3fe0000000000000'}
  >>> data_differences({"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([1.0, 2.5], np.float32)})
  ["['w']: float32[2]: 1 of 2 elements differ, first at (1,): expected 2.0, got 2.5 (2097152 ulp)"]
"""

from __future__ import annotations

import json
import struct

import ml_dtypes  # noqa: F401  (registers bfloat16, float8_* as numpy dtypes, so their names decode)
import numpy as np

from fpemu.errors import FpemuInputError

DATA_FORMAT = "fpemu-data"
DATA_VERSION = 1
_PREVIEW = 8  # readable values shown beside an array's bytes


def _float(value: float) -> dict:
    return {"float": repr(value), "bits": struct.pack(">d", value).hex()}


def _array(value: np.ndarray) -> dict:
    if value.dtype.hasobject or value.dtype.fields is not None:
        raise TypeError(f"an array of dtype {value.dtype} (object and structured arrays have no fixed bit pattern)")
    little = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
    return {"ndarray": {"dtype": little.dtype.name, "shape": list(value.shape), "bytes": little.tobytes().hex(),
                        "first": [str(v) for v in little.reshape(-1)[:_PREVIEW]]}}


def encode_data(value, where: str = "data"):
    """``value`` as lossless JSON-safe data (see the module docstring).

    Raises:
      FpemuInputError: a part that cannot be stored (a non-string dict key, an object array, a
        type that is neither plain data nor array-like), named by its path (``data['w'][2]``).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise FpemuInputError(f"{where}: dict keys must be strings, got {bad[0]!r}")
        return {key: encode_data(value[key], f"{where}[{key!r}]") for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [encode_data(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
        try:
            return _array(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as error:
            raise FpemuInputError(f"{where}: cannot store {type(value).__name__}: {error}") from None
    raise FpemuInputError(f"{where}: cannot store a {type(value).__name__}; expected None, bool, int, float, str, "
                          "dict (string keys), list, tuple or an array (numpy, or anything with __array__)")


def _decode_array(body: dict) -> np.ndarray:
    dtype = np.dtype(body["dtype"]).newbyteorder("<")
    return np.frombuffer(bytes.fromhex(body["bytes"]), dtype).reshape(body["shape"]).astype(body["dtype"])


def decode_data(encoded):
    """The value :func:`encode_data` encoded (tuples come back as lists, numpy scalars as 0-d arrays)."""
    if isinstance(encoded, list):
        return [decode_data(item) for item in encoded]
    if isinstance(encoded, dict):
        if set(encoded) == {"float", "bits"}:
            return struct.unpack(">d", bytes.fromhex(encoded["bits"]))[0]
        if set(encoded) == {"ndarray"}:
            return _decode_array(encoded["ndarray"])
        return {key: decode_data(item) for key, item in encoded.items()}
    return encoded


def dumps_data(value) -> str:
    """The golden file's text: sorted keys, one value per line (a change is a short diff)."""
    body = {"format": DATA_FORMAT, "version": DATA_VERSION, "data": encode_data(value)}
    return json.dumps(body, sort_keys=True, indent=1) + "\n"


def loads_data(text: str, path: str = "<string>"):
    """The encoded data of a golden file's text (compare it with :func:`encode_data` of a value)."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise FpemuInputError(f"{path}: not a data golden: invalid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(body, dict) or body.get("format") != DATA_FORMAT or "data" not in body:
        raise FpemuInputError(f"{path}: not a data golden: 'format' is not {DATA_FORMAT!r}")
    if body.get("version") != DATA_VERSION:
        raise FpemuInputError(f"{path}: data golden version {body.get('version')!r}; this fpemu reads {DATA_VERSION}")
    return body["data"]


def _kind(encoded) -> str:
    if isinstance(encoded, dict):
        return "float" if set(encoded) == {"float", "bits"} else "array" if set(encoded) == {"ndarray"} else "dict"
    return "list" if isinstance(encoded, list) else type(encoded).__name__


def _show(encoded) -> str:
    kind = _kind(encoded)
    if kind == "float":
        return encoded["float"]
    if kind == "array":
        body = encoded["ndarray"]
        return f"{body['dtype']}{body['shape']}"
    text = json.dumps(encoded, sort_keys=True) if kind in ("dict", "list") else repr(encoded)
    return text if len(text) <= 60 else text[:57] + "..."


def _ulps(a: np.ndarray, b: np.ndarray) -> str:
    """`` (N ulp)`` between two float values of one float dtype, '' for other dtypes."""
    if a.dtype.kind != "f" and not a.dtype.name.startswith(("bfloat", "float8", "float4", "float6")):
        return ""
    bits = np.dtype(f"u{a.dtype.itemsize}")
    ia, ib = (int(v.view(bits)) for v in (np.asarray(a), np.asarray(b)))
    sign = 1 << (8 * a.dtype.itemsize - 1)
    ia, ib = (-(v ^ sign) if v & sign else v for v in (ia, ib))
    return f" ({abs(ia - ib)} ulp)"


def _array_difference(expected: dict, got: dict) -> str:
    a, b = _decode_array(expected["ndarray"]), _decode_array(got["ndarray"])
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"expected {_show(expected)}, got {_show(got)}"
    differ = np.frombuffer(a.tobytes(), np.uint8).reshape(a.size, -1) != np.frombuffer(b.tobytes(), np.uint8).reshape(
        b.size, -1)
    rows = np.flatnonzero(differ.any(axis=1))
    first = np.unravel_index(rows[0], a.shape)
    first = tuple(int(i) for i in first)
    return (f"{_show(expected)}: {rows.size} of {a.size} elements differ, first at {first}: "
            f"expected {str(a[first])}, got {str(b[first])}{_ulps(a[first], b[first])}")


def _differences(expected, got, path: str, out: list) -> None:
    if expected == got:
        return
    kinds = _kind(expected), _kind(got)
    if kinds == ("dict", "dict"):
        for key in sorted(set(expected) | set(got)):
            if key not in got:
                out.append(f"{path}[{key!r}]: missing (expected {_show(expected[key])})")
            elif key not in expected:
                out.append(f"{path}[{key!r}]: not in the golden (got {_show(got[key])})")
            else:
                _differences(expected[key], got[key], f"{path}[{key!r}]", out)
    elif kinds == ("list", "list") and len(expected) == len(got):
        for index, (a, b) in enumerate(zip(expected, got)):
            _differences(a, b, f"{path}[{index}]", out)
    elif kinds == ("array", "array"):
        out.append(f"{path}: {_array_difference(expected, got)}")
    elif kinds == ("list", "list"):
        out.append(f"{path}: expected {len(expected)} items, got {len(got)}")
    else:
        bits = f" (bits {expected['bits']} -> {got['bits']})" if kinds == ("float", "float") else ""
        out.append(f"{path}: expected {_show(expected)}, got {_show(got)}{bits}")


def data_differences(expected, got, encoded: bool = False) -> list:
    """One line per path where ``got`` differs from ``expected`` (keys sorted), [] when they are the same
    bit for bit; ``encoded=True`` takes both as :func:`encode_data` output already."""
    if not encoded:
        expected, got = encode_data(expected, "expected"), encode_data(got, "got")
    out = []
    _differences(expected, got, "", out)
    return [line[2:] if line.startswith(": ") else line for line in out]
