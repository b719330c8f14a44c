"""Transformer Engine's own Python recipe code, run on the CPU from its source tree.

TE cannot be pip-installed without CUDA, and importing ``transformer_engine.pytorch`` loads its
CUDA extension.  The recipe arithmetic this module drives is pure torch, though: the unfused
delayed-scaling update (``pytorch/quantization.py``: ``_amax_and_scale_update`` and the functions
it calls, under ``torch.jit.script`` as in TE) with the real ``DelayedScaling`` recipe class
(``common/recipe/__init__.py``, pydantic), and the current-scaling reference quantizer's
``_scale_from_amax_tensor`` (``pytorch/custom_recipes/reference_current_scaling.py``).  Those
functions are taken unchanged from the files (by name, with ``ast``) and executed with torch;
nothing of TE is reimplemented here.  The fused ``kernel_bulk`` and the CUDA current-scaling
kernel need a GPU and TE's build.

Where the source is: ``FPEMU_TE_SOURCE`` names a TransformerEngine checkout, or a git directory
holding commit :data:`TE_COMMIT` (a bare mirror is enough); by default
``~/.cache/fpemu/TransformerEngine``, which needs only the four files driven::

    git --git-dir=MIRROR archive d0067d0da6cb01811b8072a7d304f0e00344ce2b \
        transformer_engine/pytorch/quantization.py transformer_engine/pytorch/jit.py \
        transformer_engine/common/recipe/__init__.py \
        transformer_engine/pytorch/custom_recipes/reference_current_scaling.py \
        | tar x -C ~/.cache/fpemu/TransformerEngine
"""

from __future__ import annotations

import ast
import functools
import hashlib
import linecache
import os
import pathlib
import subprocess
import sys
import types

import numpy as np

TE_COMMIT = "d0067d0da6cb01811b8072a7d304f0e00344ce2b"
_QUANTIZATION = "transformer_engine/pytorch/quantization.py"
_JIT = "transformer_engine/pytorch/jit.py"
_RECIPE = "transformer_engine/common/recipe/__init__.py"
_REFERENCE = "transformer_engine/pytorch/custom_recipes/reference_current_scaling.py"
_UNFUSED_FUNCTIONS = ("_update_amax_history", "_default_get_amax_and_update_history", "_default_sf_compute",
                      "_compute_amax_and_update_history", "_compute_scaling_factor", "_amax_and_scale_update")
SOURCE_ENV = "FPEMU_TE_SOURCE"
_DEFAULT_ROOT = pathlib.Path("~/.cache/fpemu/TransformerEngine")
# sha256 (first 16 hex digits) of each file at TE_COMMIT: a checkout holding these is that commit.
_PINNED = {_QUANTIZATION: "ac39399a9e09c378", _JIT: "40307700c1a53260", _RECIPE: "f4a8b37f20c09573",
           _REFERENCE: "84f6ec764019ae8f"}


def _source_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get(SOURCE_ENV) or _DEFAULT_ROOT).expanduser()


def unreadable(paths) -> bool:
    """Whether any of TE's files ``paths`` cannot be read from the source root."""
    try:
        for path in paths:
            _read(path)
    except (OSError, subprocess.CalledProcessError):
        return True
    return False


def te_source_unavailable():
    """Why TE's source cannot be read here (None when it can)."""
    if unreadable(_PINNED):
        return (f"no TransformerEngine source at {_source_root()} (set {SOURCE_ENV} to a checkout or git mirror "
                f"holding commit {TE_COMMIT[:7]}; see fpemu.adapters.te_recipes)")
    return None


def te_source_versions(pinned: dict = None) -> dict:
    """The TE source driven: the pinned commit when every file is the pinned one (``pinned``: path ->
    digest, by default this module's files), else "modified"."""
    pinned = _PINNED if pinned is None else pinned
    try:
        same = all(hashlib.sha256(_read(path).encode()).hexdigest()[:16] == digest for path, digest in pinned.items())
    except (OSError, subprocess.CalledProcessError):  # absent: a skipped job's line still names its versions
        return {"transformer_engine (source)": "not found"}
    return {"transformer_engine (source)": TE_COMMIT[:12] if same else "modified (not d0067d0)"}


@functools.lru_cache(maxsize=None)
def _read(path: str) -> str:
    root = _source_root()
    if (root / path).is_file():
        return (root / path).read_text(encoding="utf-8")
    return subprocess.run(["git", "--git-dir", str(root), "show", f"{TE_COMMIT}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def _functions(path: str, names, namespace: dict, within: str = None) -> dict:
    """Execute the functions ``names`` of TE's file ``path`` (top-level ones, or the methods of class
    ``within`` as plain functions) in ``namespace``; decorators are kept, except a method's classmethod."""
    tree = ast.parse(_read(path), filename=path)
    body = tree.body
    if within is not None:
        body = next(node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == within)
    chosen = [node for node in body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {node.name for node in chosen}
    if missing:
        raise AttributeError(f"{path} at {TE_COMMIT[:7]} has no function {', '.join(sorted(missing))}")
    for node in chosen:
        node.decorator_list = [d for d in node.decorator_list
                               if not (isinstance(d, ast.Name) and d.id == "classmethod")]
    filename = f"<TE {path}>"
    # torch.jit.script reads a function's source through inspect: linecache serves TE's file under
    # that name, and the functions belong to a named module.
    text = _read(path)
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace.setdefault("__name__", "fpemu_te_" + pathlib.PurePath(path).stem)
    sys.modules.setdefault(namespace["__name__"], types.ModuleType(namespace["__name__"]))
    exec(compile(ast.Module(body=chosen, type_ignores=[]), filename, "exec"), namespace)
    return namespace


@functools.lru_cache(maxsize=None)
def te_recipe_module() -> types.ModuleType:
    """TE's ``transformer_engine.common.recipe`` (stdlib and pydantic only), loaded from its file."""
    module = types.ModuleType("transformer_engine_common_recipe")
    module.__file__ = f"<TE {_RECIPE}>"
    sys.modules[module.__name__] = module  # pydantic resolves the dataclasses' annotations through it
    exec(compile(_read(_RECIPE), module.__file__, "exec"), module.__dict__)
    return module


@functools.lru_cache(maxsize=None)
def _unfused(compiled: bool) -> dict:
    import typing
    import torch
    namespace = {"torch": torch, "Tuple": typing.Tuple, "Union": typing.Union, "Callable": typing.Callable,
                 "Optional": typing.Optional, "DelayedScaling": te_recipe_module().DelayedScaling}
    # TE's jit_fuser is lazy_compile (torch.compile on first call) unless NVTE_TORCH_COMPILE=0.
    jit = _functions(_JIT, ("lazy_compile",), {"torch": torch, "wraps": functools.wraps})
    namespace["jit_fuser"] = jit["lazy_compile"] if compiled else (lambda func: func)
    return _functions(_QUANTIZATION, _UNFUSED_FUNCTIONS, namespace)


def run_delayed_unfused(amaxes, fp8_format="fp8_e4m3fn", margin=0, amax_history_len=1024,
                        amax_compute_algo="max", compiled=False) -> dict:
    """Drive TE's unfused update over one amax per step: {"amax", "amax_used", "scale"} per step.

    Each step writes the amax into ``amax_history[0]`` (what TE's cast kernel does) and calls
    ``_amax_and_scale_update(amax_history, scale, fp8_max, recipe)`` with a real DelayedScaling.
    ``amax_used`` is the amax the update computed the scale from, read by running TE's own
    ``_default_get_amax_and_update_history`` on a copy of the history.
    """
    import torch
    te = te_recipe_module()
    functions = _unfused(compiled)
    recipe = te.DelayedScaling(margin=margin, amax_history_len=amax_history_len,
                               amax_compute_algo=amax_compute_algo)
    fp8_max = {"fp8_e4m3fn": te.Format.HYBRID.value.max_fwd, "fp8_e5m2": te.Format.HYBRID.value.max_bwd}[fp8_format]
    history = torch.zeros((amax_history_len, 1), dtype=torch.float32)
    scale = torch.ones(1, dtype=torch.float32)
    held, used, scales = [], [], []
    for amax in amaxes:
        history[0].fill_(float(amax))
        held.append(float(history[0].item()))
        _, amax_used = functions["_default_get_amax_and_update_history"](history.clone(), amax_compute_algo)
        functions["_amax_and_scale_update"](history, scale, fp8_max, recipe)
        used.append(float(amax_used.item()))
        scales.append(float(scale.item()))
    return {"amax": held, "amax_used": used, "scale": scales}


def record_delayed_unfused(amaxes, params, device) -> dict:
    """The recipe adapter ``te_unfused`` (fpemu.adapters.ADAPTERS): TE's unfused update, eager
    (``NVTE_TORCH_COMPILE=0``; :func:`run_delayed_unfused` with compiled=True gives the same scales)."""
    return run_delayed_unfused(amaxes, **params)


@functools.lru_cache(maxsize=None)
def _reference_functions() -> dict:
    import typing
    import torch
    namespace = _functions(_REFERENCE, ("_scale_from_amax_tensor",), {"torch": torch, "Tuple": typing.Tuple,
                                                                       "Optional": typing.Optional})
    return _functions(_REFERENCE, ("compute_scale", "_quantize"), namespace, within="CurrentScalingQuantizerRef")


def _fp8_dtype(fp8_format: str):
    import torch
    return {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fp8_format]


def reference_current_scale(amax, fp8_format="fp8_e4m3fn", eps=0.0, pow_2_scales=False, x_dtype="float32"):
    """TE's reference ``_scale_from_amax_tensor`` on one float32 amax: (scale, scale_inv, amax after its
    epsilon floor) as floats."""
    import torch
    scale, scale_inv, amax = _reference_functions()["_scale_from_amax_tensor"](
        getattr(torch, x_dtype), torch.tensor([float(amax)], dtype=torch.float32), _fp8_dtype(fp8_format),
        eps=eps, pow_2_scales=pow_2_scales)
    return float(scale.item()), float(scale_inv.item()), float(amax.item())


_INPUT_DTYPES = {3.4028234663852886e38: "float32", 3.3895313892515355e38: "bfloat16", 65504.0: "float16"}


def record_reference_current(amaxes, params, device) -> dict:
    """The recipe adapter ``te_reference``: the reference quantizer's scale of each step's amax (the
    model's ``input_max`` names the input dtype: float32's, bf16's or fp16's max)."""
    import torch
    input_max = params.get("input_max", 3.4028234663852886e38)
    if input_max not in _INPUT_DTYPES:
        raise ValueError(f"input_max: TE's reference takes it from the input dtype; "
                         f"expected one of {sorted(_INPUT_DTYPES)}")
    rows = [reference_current_scale(a, params.get("fp8_format", "fp8_e4m3fn"), params.get("amax_epsilon", 0.0),
                                    params.get("power_2_scales", False), _INPUT_DTYPES[input_max]) for a in amaxes]
    held = torch.tensor(amaxes, dtype=torch.float32).tolist()
    return {"amax": held, "amax_used": [r[2] for r in rows], "scale": [r[0] for r in rows],
            "scale_inv": [r[1] for r in rows]}


def reference_current_quantize(x, fp8_format="fp8_e4m3fn", eps=0.0, pow_2_scales=False, dtype="float32"):
    """``CurrentScalingQuantizerRef._quantize`` (TE's method body, with its ``compute_scale``) on a 2-D
    tensor held as torch ``dtype`` (float32, bfloat16 or float16), rowwise only and without amax
    reduction.  Its ``self`` is a plain holder of the attributes the method reads (the class's base,
    TE's Quantizer, needs TE's extension).
    Returns (scale_inv, fp8 codes as uint8 numpy).
    """
    import torch
    functions = _reference_functions()
    holder = types.SimpleNamespace(with_amax_reduction=False, dtype=_fp8_dtype(fp8_format), eps=eps,
                                   pow_2_scales=pow_2_scales, rowwise_usage=True, columnwise_usage=False)
    holder.compute_scale = lambda *args, **kwargs: functions["compute_scale"](holder, *args, **kwargs)
    tensor = torch.as_tensor(np.asarray(x, dtype=np.float32)).to(getattr(torch, dtype))
    qx, sx, _, _ = functions["_quantize"](holder, tensor)
    return float(sx.item()), qx.view(torch.uint8).numpy()
