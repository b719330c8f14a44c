"""emulate_torch: a TorchDispatchMode that runs a torch model's step with every op rounded per a Policy.

How it works (the WHY of each part):

* Tensors carry the dtype the real run would give them: float16 or bfloat16 where the op computes in
  the low format (their values are the format's values), float32 elsewhere.  Autograd therefore
  sees the real run's dtypes and casts gradients as it would (a float16 forward output gets a float16
  gradient), which is where the bias-gradient sums that overflow in fp16 come from.
* Under ``autocast`` placement, torch's own CPU autocast does the casts.  For the CUDA table, the
  AutocastCPU kernels are replaced for the duration by Python kernels that apply the CUDA table
  read off the dispatcher (``_autocast_table``): ops registered only for CPU fall through, banned
  and unreadable ops raise, naming the op.
* Below autograd, the mode computes every op that has a low-format input or result in float32 from
  the exact float32 values of its inputs and rounds each low result once with fpemu's kernel
  (``_torch_rounding``).  Matmuls and reductions accumulate in float32 (``accumulation="fp32"``);
  ``"low"`` rounds their running sums (``_torch_accumulation``: matrix products, sums, means and
  convolutions; it refuses every other op that may accumulate, by name).  Ops the policy leaves in float32
  run untouched and are listed.  The optimizer step runs untouched too: float32 master weights.
* Module attribution: forward ops take the innermost module whose forward is running (global module
  hooks).  When a module's forward returns, the autograd nodes it created (those reachable from its
  outputs, newer than its start) are mapped to it; a backward op takes the module of the node the
  engine is running (``torch._C._current_autograd_node``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fpemu.emulate import _autocast_table
from fpemu.emulate._torch_accumulation import low_accumulated
from fpemu.emulate._torch_kernels import NO_FLOAT32_CALL, run_as_low_kernel, runs_low_kernel
from fpemu.emulate._torch_rounding import carrier, normal_counts, round_tensor, rounding_counts
from fpemu.emulate.policy import GEMM_OPS, Policy, check_framework, get_policy
from fpemu.emulate.telemetry import ROOT, Telemetry
from fpemu.errors import FpemuInputError

# Ops whose bool argument asks for a float32 result from a low input (softmax's half_to_float): in
# float32 compute the flag must be off, and the result is float32 either way.
_FLOAT_FLAGS = {"aten::_softmax": 2, "aten::_log_softmax": 2}
_EXCLUDE_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
# Facts of the installed torch, the same for every emulation: each op's schema reading, and the
# result dtypes of an op for a signature of argument dtypes (a meta run each).
_OP_INFOS, _RESULT_DTYPES = {}, {}


def op_name(func) -> str:
    """``aten::mm`` or ``aten::sum.dim_IntList``, as autocast's table names ops."""
    overload = func._overloadname
    return func._schema.name + ("" if overload == "default" else f".{overload}")


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    name: str
    packet: str                  # aten::sum
    passthrough: bool            # views, prim ops, ops without tensor results: never rounded
    mutated: tuple               # (position, name) of the arguments the op writes (in-place, out=)
    returns_list: bool           # a Tensor[] result, whose length its int arguments decide (split, unbind)


def _op_info(func) -> _OpInfo:
    schema = func._schema
    returns_tensor = any("Tensor" in str(r.type) for r in schema.returns)
    is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    mutated = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    returns_list = any(str(r.type).startswith("List[") for r in schema.returns)
    return _OpInfo(op_name(func), schema.name, func.namespace == "prim" or is_view or not returns_tensor, mutated,
                   returns_list)


def _leaves(value, out: list) -> list:
    if isinstance(value, (tuple, list)):
        for item in value:
            _leaves(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _leaves(item, out)
    else:
        out.append(value)
    return out


def _map(value, fn):
    if isinstance(value, tuple):
        return tuple(_map(item, fn) for item in value)
    if isinstance(value, list):
        return [_map(item, fn) for item in value]
    if isinstance(value, dict):
        return {key: _map(item, fn) for key, item in value.items()}
    return fn(value)


class _Runtime:
    """The state of one emulation: policy, telemetry, module attribution, caches."""

    def __init__(self, policy: Policy, telemetry: Telemetry, model):
        self.policy = policy
        self.telemetry = telemetry
        # Only autocast's casts are autograd ops, so only there may a tensor's dtype differ from the
        # float32 autograd expects: the other placements keep float32 tensors holding the format's values.
        self.low = carrier(policy.compute) if policy.placement == "autocast" else torch.float32
        self.kernel_dtype = carrier(policy.compute)  # the dtype whose CPU kernels the real run calls
        self.min_normal = {fmt.name: fmt.min_normal for fmt in (policy.compute, policy.backward_format)}
        self.names = ({id(m): (name or type(m).__name__) for name, m in model.named_modules()}
                      if model is not None else {})
        self.module_stack, self.node_modules = [], {}
        self.optimizer_depth = 0
        self.rounding_calls = 0
        self._probe = torch.zeros((), requires_grad=True)
        self.cast_cache = {}  # autocast's cached weight casts, for one forward pass
        # delayed fp8 scaling: each operand's recipe state, keyed by where it is cast (direction, module,
        # op, operand, n-th such cast since the last forward began at the root), those counts, the recipes
        self.fp8_states, self.fp8_uses, self.fp8_recipes = {}, {}, {}

    # -- where an op runs ---------------------------------------------------
    def direction(self) -> str:
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def module(self, direction: str) -> str:
        if direction == "forward":
            return self.module_stack[-1][0] if self.module_stack else ROOT
        return self.node_modules.get(torch._C._current_autograd_node(), ROOT)

    def module_entered(self, module) -> None:
        if not self.module_stack:
            self.clear_casts()  # a new forward: weights may have changed since the last
            self.fp8_uses.clear()
        start = self._probe.view(()).grad_fn._sequence_nr() if torch.is_grad_enabled() else None
        self.module_stack.append((self.names.get(id(module), type(module).__name__), start))
        self.telemetry.location = self.module_stack[-1][0]

    def module_left(self, outputs) -> None:
        name, start = self.module_stack.pop()
        self.telemetry.location = self.module_stack[-1][0] if self.module_stack else None
        if start is None:
            return
        pending = [t.grad_fn for t in _leaves(outputs, []) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node is None or node in self.node_modules or node._sequence_nr() < start:
                continue
            self.node_modules[node] = name
            pending.extend(next_node for next_node, _ in node.next_functions)

    def clear_casts(self) -> None:
        self.cast_cache.clear()
        torch.clear_autocast_cache()

    def step_finished(self, optimizer) -> None:
        self.node_modules.clear()
        self.clear_casts()
        self.fp8_uses.clear()
        if self.policy.update_rounding is None:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.copy_(self.round(param.float(), "optimizer.step (weights)", "forward",
                                           rounding=self.policy.update_rounding).to(param.dtype))

    # -- rounding -----------------------------------------------------------
    def round(self, values, op: str, direction: str, fmt=None, rounding=None):
        """float32 ``values`` rounded to the policy's format, in its carrier dtype; counted."""
        fmt = fmt or (self.policy.compute if direction == "forward" or self.policy.placement != "fp8"
                      else self.policy.backward_format)
        rounding = rounding or self.policy.rounding
        self.rounding_calls += 1
        seed = (self.policy.seed << 32) + self.rounding_calls if rounding == "stochastic" else None
        dtype = self.low if fmt == self.policy.compute else torch.float32
        rounded = round_tensor(values, fmt, dtype, rounding, self.policy.overflow, self.policy.subnormals, seed)
        counts, nonfinite = rounding_counts(values, rounded, self.min_normal[fmt.name])
        self.telemetry.record(direction, op, self.module(direction), counts, nonfinite)
        return rounded

    # -- dispatch -----------------------------------------------------------
    def info(self, func) -> _OpInfo:
        info = _OP_INFOS.get(func)
        if info is None:
            info = _OP_INFOS[func] = _op_info(func)
        return info

    def dispatch(self, func, args, kwargs):
        info = self.info(func)
        if info.passthrough or self.optimizer_depth:
            return func(*args, **kwargs)
        leaves = _leaves((args, kwargs), [])  # (once per op: the autocast path reads them again)
        floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats:
            return func(*args, **kwargs)
        placement = self.policy.placement
        if placement == "fp8":
            return self._fp8(func, info, args, kwargs)
        self._check_dtypes(info, floats)
        if placement == "autocast":
            return self._autocast(func, info, args, kwargs, leaves, floats)
        return self._compute(func, info, args, kwargs, targets=None)

    def _check_dtypes(self, info: _OpInfo, floats) -> None:
        # float64 under autocast: autocast leaves it alone, and torch's own float32 ops make some
        # (linalg_matrix_rank's tolerance); the pure placement has no float64 to give it
        allowed = (torch.float32, self.low) + ((torch.float64,) if self.policy.placement == "autocast" else ())
        for tensor in floats:
            if tensor.dtype not in allowed:
                raise FpemuInputError(
                    f"policy {self.policy.name} cannot place {info.name}: it received a {tensor.dtype} tensor; "
                    f"the policy computes in {self.policy.compute.name} and "
                    + ("float32 (float64 left alone)" if torch.float64 in allowed else "float32 only"))

    def _autocast(self, func, info, args, kwargs, leaves, floats):
        low = self.low
        if all(t.dtype != low for t in floats) and not any(v is low for v in leaves):
            self.telemetry.left_in_float32(info.name)
            return func(*args, **kwargs)
        targets = self._targets(func, info, args, kwargs, leaves)
        if low not in targets:
            self.telemetry.left_in_float32(info.name)
        return self._compute(func, info, args, kwargs, targets)

    def _targets(self, func, info, args, kwargs, leaves) -> tuple:
        """The dtypes of the op's results on the tensors' dtypes (a meta run, cached per signature); ``leaves``:
        the arguments' leaves."""
        # what decides result dtypes: tensors' dtypes (0-dim ones promote less), dtype and bool arguments,
        # and the Python type of scalars (int * 2.5 is float); and, for a list result, how many tensors
        # it holds, which shapes and int arguments decide (12 and 16 rows split by 4 would share an entry)
        listed = info.returns_list
        signature = tuple((v.dtype, tuple(v.shape) if listed else v.dim() == 0) if isinstance(v, torch.Tensor)
                          else v if isinstance(v, (torch.dtype, bool)) or (listed and isinstance(v, int))
                          else type(v) for v in leaves)
        key = (func, signature)
        targets = _RESULT_DTYPES.get(key)
        if targets is None:
            def meta(v):  # the op on meta tensors (and the meta device: a copy to the CPU has no data)
                if isinstance(v, torch.Tensor):
                    return torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device="meta")
                return torch.device("meta") if isinstance(v, torch.device) else v
            try:
                out = func(*_map(args, meta), **_map(kwargs, meta))
            except NotImplementedError as error:  # (a shape error is the model's own, and propagates)
                raise FpemuInputError(f"policy {self.policy.name} cannot place {info.name}: torch has no meta "
                                      f"kernel to give its result dtypes ({error})") from None
            targets = _RESULT_DTYPES[key] = tuple(
                v.dtype if isinstance(v, torch.Tensor) else None for v in _leaves(out, []))
        return targets

    def _compute(self, func, info, args, kwargs, targets):
        """Run the op in float32 on exact float32 inputs; round the results ``targets`` marks low
        (None: every floating result, the pure placement); write back what the op mutates."""
        direction = self.direction()
        low, pure = self.low, targets is None
        if not pure and runs_low_kernel(info.packet, self.policy):
            return self._low_kernel(func, info, args, kwargs, targets, direction)

        def upcast(v):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                if v.dtype == low and low != torch.float32:
                    return v.float()
                if pure and not _is_rounded(v):
                    return self.round(v, f"{info.name} (input)", direction)
                return v
            return torch.float32 if v is low else v

        up_args, up_kwargs = _map(args, upcast), _map(kwargs, upcast)
        flag = _FLOAT_FLAGS.get(info.packet)
        if flag is not None and len(up_args) > flag and up_args[flag]:
            up_args = up_args[:flag] + (False,) + up_args[flag + 1:]
        out = run_as_low_kernel(lambda: self._run(func, info, up_args, up_kwargs, direction), info.packet,
                                args, kwargs, self.kernel_dtype)
        results = _leaves(out, [])
        rounded = []
        for index, value in enumerate(results):
            target = None if targets is None else (targets[index] if index < len(targets) else None)
            is_low = (pure and isinstance(value, torch.Tensor) and value.is_floating_point()) or target == low
            is_low = is_low and value.dtype == torch.float32
            rounded.append(self.round(value, info.name, direction) if is_low else value)
        if pure:
            _tag(rounded, "_fpemu_rounded")
        swapped = {}
        for position, name in info.mutated:
            original, written = _argument(args, kwargs, position, name), _argument(up_args, up_kwargs, position, name)
            if written is not original:  # the op wrote into a float32 copy: the original takes its rounded result
                original.copy_(next((r for v, r in zip(results, rounded) if v is written), written))
                swapped[id(written)] = original
        rounded = [swapped.get(id(v), r) for v, r in zip(results, rounded)]
        if isinstance(out, torch.Tensor):
            return rounded[0]
        return _rebuild(out, iter(rounded))

    def _low_kernel(self, func, info, args, kwargs, targets, direction):
        """The op as torch's own low-precision CPU kernel computes it, on the real run's dtypes
        (``_torch_kernels.CPU_LOW_KERNELS`` says why).  Each low result is counted as a rounding of
        the op's float32 result, which is computed only when some low result is zero, subnormal or
        non-finite (else nothing underflowed or overflowed), and never for ``NO_FLOAT32_CALL``."""
        out = func(*args, **kwargs)
        results, reference = _leaves(out, []), None
        for index, value in enumerate(results):
            if not (index < len(targets) and targets[index] == self.low and isinstance(value, torch.Tensor)
                    and value.dtype == self.low):
                continue
            min_normal = self.min_normal[self.policy.compute.name]
            counts, nonfinite = normal_counts(value, min_normal), None
            if counts is None and info.packet in NO_FLOAT32_CALL:
                counts, nonfinite = rounding_counts(value.float(), value, min_normal)
            elif counts is None:
                reference = reference or _leaves(self._float32_reference(func, args, kwargs), [])
                counts, nonfinite = rounding_counts(reference[index], value, min_normal)
            self.telemetry.record(direction, info.name, self.module(direction), counts, nonfinite)
        return out

    def _float32_reference(self, func, args, kwargs):
        """The op in float32 on float32 copies of its low inputs and copies of the rest: it may write
        into them (native_batch_norm updates its running statistics, unannotated in its schema)."""
        def copied(v):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.float() if v.dtype == self.low else v.clone()
            return v
        return func(*_map(args, copied), **_map(kwargs, copied))

    def _run(self, func, info, args, kwargs, direction):
        if self.policy.accumulation == "low":
            out = low_accumulated(func, info.name, info.packet, args, kwargs, self.policy.accumulation_block,
                                  lambda v: self.round(v, f"{info.name} (partial sum)", direction).float())
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _fp8(self, func, info, args, kwargs):
        direction = self.direction()
        operands = GEMM_OPS.get(info.packet.removeprefix("aten::"))
        if operands is None:
            self.telemetry.left_in_float32(info.name)
            out = func(*args, **kwargs)
            if direction == "backward":
                _tag_gradients(out)
            return out
        names = [a.name for a in func._schema.arguments]
        args = list(args)
        for position, name in enumerate(names):
            value = args[position] if position < len(args) else kwargs.get(name)
            if name in operands and isinstance(value, torch.Tensor):
                fmt = (self.policy.backward_format if direction == "backward" and _is_gradient(value)
                       else self.policy.compute)
                scaled = self._fp8_quantized(value, info.name, name, direction, fmt)
                if position < len(args):
                    args[position] = scaled
                else:
                    kwargs = {**kwargs, name: scaled}
        out = func(*args, **kwargs)
        if direction == "backward":
            _tag_gradients(out)
        return out

    def _fp8_cast(self, op, operand, direction, fmt) -> tuple:
        """(state key, name) of an fp8 cast: where it is cast (direction, module, op, operand) and which
        such cast it is since the last forward began at the root (0, 1, ...); the name adds the format."""
        place = (direction, self.module(direction), op, operand)
        uses = self.fp8_uses[place] = self.fp8_uses.get(place, -1) + 1
        name = f"{direction} {place[1]} {op} {operand}" + (f" #{uses}" if uses else "") + f" {fmt.name}"
        return place + (uses,), name

    def _fp8_quantized(self, value, op, operand, direction, fmt):
        """value quantized to fmt with its scale (the policy's fp8_scaling), dequantized (float32); the
        cast's amax and scale go into the step's telemetry."""
        key, name = self._fp8_cast(op, operand, direction, fmt)
        if self.policy.fp8_scaling == "delayed":
            out, amax, scale = self._fp8_delayed(value, key, op, direction, fmt)
        else:
            amax = float(value.detach().abs().max()) if value.numel() else 0.0
            exponent = 0 if not (amax > 0 and math.isfinite(amax)) else _scale_exponent(fmt.max_finite, amax)
            scale = math.ldexp(1.0, exponent)
            out = self.round(value * scale, op, direction, fmt=fmt) / scale
        self.telemetry.record_fp8(name, amax, scale)
        return out

    def _fp8_delayed(self, value, key, op, direction, fmt) -> tuple:
        """Transformer Engine's delayed scaling: cast with the scale the operand's amax history gave
        (``fl32(x * scale)``, dequantized by ``fl32(1 / scale)``), then its amax enters the history.
        Returns (the dequantized values, the amax, the scale)."""
        from fpemu.scalers.fp8_recipes import te_amax
        if fmt.name not in self.fp8_recipes:
            self.fp8_recipes[fmt.name] = self.policy.delayed_scaling(fmt)
        recipe = self.fp8_recipes[fmt.name]
        state = self.fp8_states.get(key) or recipe.init()
        scale = torch.tensor(state.scale, dtype=torch.float32)
        inverse = torch.tensor(1.0, dtype=torch.float32) / scale
        amax = te_amax(value.detach().numpy())
        self.fp8_states[key] = recipe.update(state, amax)
        return self.round(value * scale, op, direction, fmt=fmt) * inverse, float(amax), state.scale


def _argument(args, kwargs, position: int, name: str):
    return args[position] if position < len(args) else kwargs.get(name)


def _tag(out, mark: str) -> None:
    """Mark the tensors of an op's result (a Python attribute: views of them are found through _base)."""
    for value in _leaves(out, []):
        if isinstance(value, torch.Tensor):
            setattr(value, mark, True)


def _marked(value, mark: str) -> bool:
    return getattr(value, mark, False) or (value._base is not None and getattr(value._base, mark, False))


def _tag_gradients(out) -> None:
    _tag(out, "_fpemu_gradient")


def _is_gradient(value) -> bool:
    """Whether fp8 reads the operand as a gradient (made in the backward pass): e5m2, not e4m3."""
    return _marked(value, "_fpemu_gradient")


def _is_rounded(value) -> bool:
    """Whether the pure placement already rounded this tensor (a result of an emulated op)."""
    return _marked(value, "_fpemu_rounded")


def _rebuild(structure, values):
    if isinstance(structure, (tuple, list)):
        return type(structure)(_rebuild(item, values) for item in structure)
    return next(values)


class _Mode(TorchDispatchMode):
    def __init__(self, runtime: _Runtime):
        super().__init__()
        self.runtime = runtime

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.runtime.dispatch(func, args, kwargs or {})


def op_table(policy) -> dict:
    """The autocast op table a policy uses, as recorded in traces: ``{"torch": ..., "key": ...,
    "ops": {"aten::mm": "low", ...}, "unclassified": [...]}``; ``{}`` for placements without one."""
    policy = get_policy(policy)
    if policy.placement != "autocast":
        return {}
    return _autocast_table.observe(policy.table_device, str(carrier(policy.compute)).removeprefix("torch."))


def _cast_kernel(op, name: str, category: str, low, policy_name: str, cache: dict):
    """A Python AutocastCPU kernel applying one table's cast policy as autocast_mode.cpp does: floating
    tensors (not float64) cast to the target; the casts of leaf tensors that require grad (weights)
    cached until the cache is cleared (a new forward pass, an optimizer step).  In the backward pass it
    casts nothing: real autocast wraps the forward only, and the backward ops take the dtypes the
    forward gave (CPU autocast would otherwise still be on in TLS while the CPU engine runs)."""
    def cast(value, target, eligible):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype in eligible):
            return value
        if value.is_leaf and value.requires_grad and torch.is_grad_enabled():
            hit = cache.get((id(value), target))
            if hit is None or hit[0] is not value:
                hit = cache[(id(value), target)] = (value, value.to(target))
            return hit[1]
        return value.to(target)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST_CPU):
            if torch._C._current_graph_task_id() != -1:
                return op(*args, **kwargs)
            if category == "banned":
                raise FpemuInputError(f"policy {policy_name} cannot place {name}: CUDA autocast refuses it as unsafe "
                                      "to autocast (torch's advice: use its *_with_logits form)")
            if category == "float16" and low != torch.float16:
                raise FpemuInputError(f"policy {policy_name} cannot place {name}: CUDA autocast runs cuDNN's RNNs in "
                                      "float16 whatever its dtype (AutocastRNN.cpp), which a bfloat16 policy does not carry")
            kind = "low" if category == "float16" else category
            if kind not in ("low", "fp32", "promote"):
                raise FpemuInputError(f"policy {policy_name} cannot place {name}: the cast policy torch's CUDA "
                                      f"autocast registers for it could not be observed (torch {torch.__version__})")
            if kind == "low":
                target, eligible = low, (torch.float32,)
            elif kind == "fp32":
                target, eligible = torch.float32, (low,)
            else:
                widest = torch.float32 if any(isinstance(v, torch.Tensor) and v.dtype == torch.float32
                                              for v in _leaves((args, kwargs), [])) else low
                target, eligible = widest, (low, torch.float32)
            return op(*_map(args, lambda v: cast(v, target, eligible)),
                      **_map(kwargs, lambda v: cast(v, target, eligible)))
    return kernel


def _table_kernels(policy: Policy, cache: dict):
    """(op name, kernel) for AutocastCPU: the policy's table for every op it classifies (the CUDA table
    with the rules only CUDA builds register, its ``from_source``); for the CUDA table, a refusal for
    the ops it could not classify and a fallthrough for the ops only CPU registers.  Ops of the CPU
    table it could not classify keep torch's own CPU kernel."""
    low = carrier(policy.compute)
    table = op_table(policy)
    cuda = policy.table_device == "cuda"
    ops = {**table["ops"], **table.get("from_source", {}).get("ops", {})}
    names = set(ops) | (set(table["unclassified"]) | set(_autocast_table.registered("cpu")) if cuda else set())
    for name in sorted(names):
        op = _autocast_table.resolve(name)
        if op is None:
            continue
        if name in ops or name in table["unclassified"]:
            yield name, _cast_kernel(op, name, ops.get(name, "unclassified"), low, policy.name, cache)
        else:
            yield name, torch.library.fallthrough_kernel


@contextlib.contextmanager
def _autocast_placement(policy: Policy, cache: dict):
    """CPU autocast with the policy's table in Python kernels at AutocastCPU (removed on exit)."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point
            for name, kernel in _table_kernels(policy, cache):
                library.impl(name.removeprefix("aten::"), kernel, "AutocastCPU")
        with torch.autocast("cpu", dtype=carrier(policy.compute)):
            yield
    finally:
        library._destroy()
        cache.clear()
        torch.clear_autocast_cache()


@contextlib.contextmanager
def emulate_torch(policy="cuda_autocast_fp16", *, model=None, telemetry: Telemetry | None = None, **overrides):
    """Run torch code with every op computed and rounded as ``policy`` says (see the module docstring).

    Args:
      policy: a policy name (``fpemu.emulate.POLICIES``) or a :class:`Policy`.
      model: the ``nn.Module`` whose submodule names telemetry uses (others are named by class).
      telemetry: the :class:`Telemetry` to write into (a new one if None).
      overrides: Policy fields to replace (``rounding="stochastic"``, ``subnormals=False``, ...).

    Yields:
      The :class:`Telemetry` being written.

    Raises:
      FpemuInputError: an op the policy cannot place, named.

    Example::

        with fpemu.emulate_torch("cuda_autocast_fp16", model=model) as telemetry:
            loss = model(x).square().mean()
            (loss * 1024).backward()
        print(telemetry.summary().first_nonfinite)
    """
    policy = get_policy(policy, **overrides)
    check_framework(policy, "torch")
    telemetry = telemetry if telemetry is not None else Telemetry()
    runtime = _Runtime(policy, telemetry, model)
    module_hooks = torch.nn.modules.module
    import torch.optim.optimizer as optimizer_hooks

    def step_pre(optimizer, args, kwargs):
        runtime.optimizer_depth += 1

    def step_post(optimizer, args, kwargs):
        runtime.step_finished(optimizer)
        runtime.optimizer_depth -= 1

    handles = [module_hooks.register_module_forward_pre_hook(lambda m, a: runtime.module_entered(m)),
               module_hooks.register_module_forward_hook(lambda m, a, out: runtime.module_left(out)),
               optimizer_hooks.register_optimizer_step_pre_hook(step_pre),
               optimizer_hooks.register_optimizer_step_post_hook(step_post)]
    placement = (_autocast_placement(policy, runtime.cast_cache) if policy.placement == "autocast"
                 else contextlib.nullcontext())
    try:
        with placement, _Mode(runtime):
            yield telemetry
    finally:
        for handle in handles:
            handle.remove()


def _scale_exponent(limit: float, amax: float) -> int:
    """The largest k with amax * 2**k <= limit (both positive and finite), from their frexp
    significands and exponents: exact, where floor(log2(limit / amax)) rounds twice."""
    (limit_significand, limit_exponent), (amax_significand, amax_exponent) = math.frexp(limit), math.frexp(amax)
    return limit_exponent - amax_exponent - (amax_significand > limit_significand)
