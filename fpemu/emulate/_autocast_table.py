"""Reads torch's autocast op table off its dispatcher: which ops autocast runs low, in float32, or promotes.

Autocast's casts live in C++ wrappers registered at the ``AutocastCUDA`` / ``AutocastCPU`` dispatch
keys (``aten/src/ATen/autocast_mode.cpp``); which ops have one is listed by the dispatcher
(``_dispatch_get_registrations_for_dispatch_key``), but the cast policy of each is compiled in (the
dispatcher's dump names only the file and line of the registration block, the same for every op of
a key).  It is observed instead: each registered op is called under autocast on fake tensors of the
key's device (``FakeTensorMode`` makes CUDA tensors on a machine without CUDA).  A wrapper casts the
arguments and calls the op again with its autocast key excluded, so the next kernel the dispatcher
runs is the op's at the device's Autograd key; a Python kernel registered there for the duration
(for every overload of the op: ``fp32_append_dtype`` wrappers call the overload taking a dtype)
records the dtypes the floating arguments arrive with and stops the call.  No kernel of the op runs,
so the size-1 dummy arguments need not pass its shape checks (composite ops such as conv2d or
cross_entropy_loss check shapes in C++ before dispatching anything below them):

- float32 arguments arrive low: ``low`` (autocast's ``lower_precision_fp``);
- low arguments arrive as float32, or with a float32 ``dtype`` argument added: ``fp32`` (``fp32``,
  ``fp32_set_opt_dtype``, ``fp32_append_dtype``: all compute in float32);
- a low and a float32 argument both arrive float32, two low ones stay low: ``promote``;
- autocast raises that the op is unsafe: ``banned``.

An op whose call never reaches the interception (its wrapper calls an op of another name) stays
unclassified; emulate_torch refuses it by name.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

CATEGORIES = ("low", "fp32", "promote", "banned")
# What a CPU build's dispatcher cannot show: autocast kernels that only CUDA builds register.  cuDNN's
# RNNs (nn.LSTM, nn.GRU, nn.RNN on a GPU call _cudnn_rnn) have one, registered at the Autocast key by
# aten/src/ATen/cudnn/AutocastRNN.cpp in builds with cuDNN: _cudnn_rnn_cast_reflatten casts the
# input, hx, cx and the weights to float16 -- at::kHalf, whatever autocast's dtype -- and runs cuDNN's
# RNN there.  A CPU build has no _cudnn_rnn, so the rule goes to the RNN ops it is reached from
# (their CPU composite then runs each matmul and gate as an emulated float16 op; cuDNN's fused gate
# arithmetic is not modelled).  Category ``float16``: low under a float16 policy, refused under bf16.
CUDA_ONLY_RULES = {"aten::lstm.input": "float16", "aten::gru.input": "float16", "aten::rnn_tanh.input": "float16",
                   "aten::rnn_relu.input": "float16"}
CUDA_ONLY_SOURCE = ("aten/src/ATen/cudnn/AutocastRNN.cpp, registered only in builds with cuDNN: cuDNN's RNNs "
                    "run in float16 whatever autocast's dtype")
_LOW_DTYPES = ("float16", "bfloat16")
_AUTOCAST_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}
# The key the dispatcher calls after autocast's wrapper, on a dense tensor of the device.
_AUTOGRAD_KEYS = {"cuda": "AutogradCUDA", "cpu": "AutogradCPU"}


class _Stop(Exception):
    """Raised by the interception kernel to end a probe call before any kernel of the op runs."""


# Plain values for the non-tensor arguments of a probe call (schema type -> value).
_PLAIN_VALUES = {"int": 1, "SymInt": 1, "float": 1.0, "number": 1.0, "bool": False, "str": "none",
                 "List[int]": [1], "List[SymInt]": [1], "List[float]": [1.0], "List[bool]": [False, False, False]}


def _arguments(schema, dtypes, device):
    """Positional arguments for ``schema``: size-1 vectors taking ``dtypes`` in turn (cycling), plain
    values for the rest (index lists: an integer vector); None where the schema has no value to give."""
    import torch
    args, tensors = [], iter(dtypes * 8)

    def tensor():
        return torch.empty((1,), dtype=next(tensors), device=device)

    for argument in schema.arguments:
        if argument.kwarg_only:
            continue
        kind = str(argument.type)
        if kind in ("Tensor", "Optional[Tensor]"):
            args.append(tensor())
        elif kind == "List[Tensor]":
            args.append([tensor(), tensor()])
        elif kind == "List[Optional[Tensor]]":  # indices (index, index_put): integers, never cast
            args.append([torch.zeros((1,), dtype=torch.long, device=device)])
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


@contextlib.contextmanager
def _intercepted(names, device_type: str):
    """Every overload of the ops ``names`` stops at the device's Autograd key, raising the floating
    dtypes of the arguments it received."""
    import torch

    def stop(*args, **kwargs):
        raise _Stop(_floating((args, kwargs)))

    library = torch.library.Library("aten", "IMPL")
    try:
        for packet in sorted({name.removeprefix("aten::").partition(".")[0] for name in names}):
            for overload in getattr(torch.ops.aten, packet).overloads():
                library.impl(packet if overload == "default" else f"{packet}.{overload}", stop,
                             _AUTOGRAD_KEYS[device_type])
        yield
    finally:
        library._destroy()


def _arrived_dtypes(op, dtypes, device_type: str, low):
    """The floating dtypes the op's arguments arrive with after autocast's casts, when called on
    tensors of ``dtypes``; 'banned'; None if the call never reached the interception."""
    args = _arguments(op._schema, dtypes, device_type)
    if args is None:
        return None
    try:
        with _autocast_on(device_type, low):
            op(*args)
    except _Stop as stop:
        return stop.args[0]
    except Exception as error:  # noqa: BLE001 - a wrapper that calls another op fails its checks: unread
        if "unsafe to autocast" in str(error):
            return "banned"
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
        return _arrived_dtypes(op, dtypes, device_type, low)

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
    "unclassified": [...], "read_on": "CPU"}``: the installed torch's autocast placement for
    ``device_type`` and ``low_dtype`` (``"float16"`` or ``"bfloat16"``), as its dispatcher shows it on
    this build (``read_on``: ``CPU``, or ``CUDA`` and its version); the CUDA table adds ``from_source``:
    :data:`CUDA_ONLY_RULES` and where in torch's source they are, which a CPU build does not register."""
    return _observe_cached(device_type, low_dtype)


@functools.lru_cache(maxsize=None)
def _observe_cached(device_type: str, low_dtype: str) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    low = getattr(torch, low_dtype)
    names = registered(device_type)
    table, unclassified = {}, []
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # a probe the interception misses may fail the op's checks: expected
    try:
        # warnings: the registrations override kernels (the point), and deprecated ops warn when called
        with warnings.catch_warnings(), _intercepted(names, device_type), FakeTensorMode(allow_non_fake_inputs=True):
            warnings.simplefilter("ignore")
            for name in names:
                op = resolve(name)
                category = None if op is None else _classify(op, device_type, low)
                if category is None:
                    unclassified.append(name)
                else:
                    table[name] = category
    finally:
        fake_log.setLevel(level)
    observed = {"torch": torch.__version__, "key": _AUTOCAST_KEYS[device_type], "low": low_dtype, "ops": table,
                "unclassified": unclassified, "read_on": f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"}
    if device_type == "cuda":  # what no dispatcher shows this table: rules from torch's source, named as such
        observed["from_source"] = {"ops": dict(CUDA_ONLY_RULES), "where": CUDA_ONLY_SOURCE}
    return observed


def registered(device_type: str) -> list:
    """Every op with a kernel at the device's autocast key (``aten::mm``, ...)."""
    import torch
    return sorted(torch._C._dispatch_get_registrations_for_dispatch_key(_AUTOCAST_KEYS[device_type]))


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
