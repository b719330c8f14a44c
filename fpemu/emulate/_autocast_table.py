"""Reads torch's autocast op table off its dispatcher: which ops autocast runs low, in float32, or promotes.

Autocast's casts live in C++ wrappers registered at the ``AutocastCUDA`` / ``AutocastCPU`` dispatch
keys (``aten/src/ATen/autocast_mode.cpp``); which ops have one is listed by the dispatcher
(``_dispatch_get_registrations_for_dispatch_key``), but the cast policy of each is compiled in.  It
is observed instead: each registered op is called under autocast on fake tensors of the key's device
(``FakeTensorMode`` makes CUDA tensors on a machine without CUDA) and a dispatch mode below autocast
records the dtypes of the floating arguments that arrive after autocast's casts, then stops the call
before any kernel runs (so the dummy arguments need not have valid shapes):

- float32 arguments arrive low: ``low`` (autocast's ``lower_precision_fp``);
- low arguments arrive as float32, or with a float32 ``dtype`` argument added: ``fp32`` (``fp32``,
  ``fp32_set_opt_dtype``, ``fp32_append_dtype``: all compute in float32);
- a low and a float32 argument both arrive float32, two low ones stay low: ``promote``;
- autocast raises that the op is unsafe: ``banned``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

CATEGORIES = ("low", "fp32", "promote", "banned")
_LOW_DTYPES = ("float16", "bfloat16")


class _Stop(Exception):
    """Raised by the recorder to end a probe call before any kernel runs."""


# Plain values for the non-tensor arguments of a probe call (schema type -> value); sizes of 1
# everywhere make most shape checks pass (a 1x1 matmul, a 1-channel 1x1 convolution, ...).
_PLAIN_VALUES = {"int": 1, "SymInt": 1, "float": 1.0, "number": 1.0, "bool": False, "str": "none",
                 "List[int]": [1], "List[SymInt]": [1], "List[float]": [1.0], "List[bool]": [False, False, False]}


def _arguments(schema, dtypes, device, rank: int):
    """Positional arguments for ``schema``: size-1 tensors of rank ``rank`` taking ``dtypes`` in turn
    (cycling), plain values for the rest; None where the schema has no value to give."""
    import torch
    args, tensors = [], iter(dtypes * 8)

    def tensor():
        return torch.empty((1,) * rank, dtype=next(tensors), device=device)

    for argument in schema.arguments:
        if argument.kwarg_only:
            continue
        kind = str(argument.type)
        if kind in ("Tensor", "Optional[Tensor]"):
            args.append(tensor())
        elif kind in ("List[Tensor]", "List[Optional[Tensor]]"):
            args.append([tensor(), tensor()])
        elif argument.has_default_value():
            break
        elif kind.startswith("Optional["):
            args.append(None)
        elif kind in _PLAIN_VALUES:
            args.append(_PLAIN_VALUES[kind])
        else:
            return None
    return args


def _floating(values) -> list:
    import torch
    flat = torch.utils._pytree.tree_leaves(values)
    return sorted({str(t.dtype).removeprefix("torch.") for t in flat
                   if isinstance(t, torch.Tensor) and t.is_floating_point()}
                  | {str(v).removeprefix("torch.") for v in flat if isinstance(v, torch.dtype)})


def _observed_dtypes(op, schema, dtypes, device_type: str, low):
    """What autocast makes of the op called on tensors of ``dtypes``: the floating dtypes of its
    result (a fake run: shapes and dtypes only), or, where the dummy arguments fail the op's shape
    checks, those its arguments arrive with below autocast; 'banned'; None if neither works."""
    for rank in (2, 4):
        args = _arguments(schema, dtypes, device_type, rank)
        if args is None:
            return None
        try:
            with _autocast_on(device_type, low):
                return _floating(op(*args))
        except RuntimeError as error:
            if "unsafe to autocast" in str(error):
                return "banned"
        except Exception:
            pass
    return _arrived_dtypes(op, _arguments(schema, dtypes, device_type, 2), device_type, low)


def _arrived_dtypes(op, args, device_type: str, low):
    """The floating dtypes the op's arguments have after autocast's casts (None: the probe failed)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, call_args=(), kwargs=None):
            # autocast's own casts, and the device queries made on the way to them
            if func is torch.ops.aten._to_copy.default or func.namespace == "prim":
                return func(*call_args, **(kwargs or {}))
            raise _Stop(_floating((call_args, kwargs or {})))

    try:
        with _autocast_on(device_type, low), Recorder():
            op(*args)
    except _Stop as stop:
        return stop.args[0]
    except Exception:
        return None
    return None


@contextlib.contextmanager
def _autocast_on(device_type: str, low):
    """Autocast for ``device_type`` without ``torch.autocast``, which turns itself off for CUDA on a
    machine without CUDA (the dispatcher's AutocastCUDA kernels still run on fake CUDA tensors)."""
    import torch
    before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, low)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, before[0])
        torch.set_autocast_dtype(device_type, before[1])
        torch.clear_autocast_cache()


def _classify(op, device_type: str, low) -> str | None:
    import torch
    low_name = str(low).removeprefix("torch.")

    def observed(dtypes):
        return _observed_dtypes(op, op._schema, dtypes, device_type, low)

    from_fp32 = observed([torch.float32])
    if from_fp32 == "banned":
        return "banned"
    if from_fp32 and low_name in from_fp32:
        return "low"
    from_low = observed([low])
    if from_low and "float32" in from_low:
        return "fp32"
    mixed = observed([low, torch.float32])
    if mixed and from_low and set(mixed) == {"float32"} and set(from_low) == {low_name}:
        return "promote"
    return None


def observe(device_type: str, low_dtype: str) -> dict:
    """``{"torch": version, "key": "AutocastCUDA", "ops": {"aten::mm": "low", ...},
    "unclassified": [...]}``: the installed torch's autocast placement for ``device_type`` and
    ``low_dtype`` (``"float16"`` or ``"bfloat16"``)."""
    return _observe_cached(device_type, low_dtype)


@functools.lru_cache(maxsize=None)
def _observe_cached(device_type: str, low_dtype: str) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    key = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}[device_type]
    low = getattr(torch, low_dtype)
    table, unclassified = {}, []
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # the probes' shape errors are expected, not news
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")
        for name in registered(device_type):
            op = resolve(name)
            category = None if op is None else _classify(op, device_type, low)
            if category is None:
                unclassified.append(name)
            else:
                table[name] = category
    fake_log.setLevel(level)
    return {"torch": torch.__version__, "key": key, "low": low_dtype, "ops": table,
            "unclassified": unclassified}


def registered(device_type: str) -> list:
    """Every op with a kernel at the device's autocast key (``aten::mm``, ...)."""
    import torch
    key = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}[device_type]
    return sorted(torch._C._dispatch_get_registrations_for_dispatch_key(key))


def resolve(name: str):
    """``aten::mm`` or ``aten::conv1d.padding`` as an OpOverload, None if torch.ops has none."""
    import torch
    namespace, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), base)
        return getattr(packet, overload or "default")
    except AttributeError:
        return None
