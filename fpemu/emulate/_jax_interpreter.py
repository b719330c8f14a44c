"""emulate_jax: a JAX function's jaxpr evaluated primitive by primitive, every low-precision result
rounded by fpemu's kernel to the dtype the jaxpr gives it.

How it works (the WHY of each part):

* ``jax.make_jaxpr`` gives the program as JAX states it, before XLA fuses or simplifies anything: each
  equation's output dtype (bfloat16, float16, a float8 type, float32) is what the program asks for.
  The interpreter keeps every value as a numpy array of exactly that dtype.
* Each equation is placed by one table, ``PRIMITIVES`` (primitive name -> kind).  ``arith``
  (+ - * /) runs as float32 arithmetic under the chosen :class:`fpemu.steps.StepSemantics` (FTZ/DAZ
  as XLA:CPU sets it, or IEEE; with ``fma`` a float32 multiply read by one add or sub is fused with
  it, as LLVM contracts them) through fpemu's step :class:`~fpemu.steps.kernel.Kernel`; ``xla``
  (transcendentals, powers) runs XLA's own float32 kernel on the widened inputs (the approximation
  the program runs, so a rounding is the only difference); ``chain`` (integer_pow, logistic) runs
  the ops JAX lowers them to, each rounded to the program's dtype; ``dot`` and ``reduce_sum``
  accumulate in float32 in the semantics' order and round once (``xla_cpu``: XLA's float32 dot, and
  XLA's reduce in the program's dtype, which rounds every partial sum); ``native`` (scatter-add, whose
  parameters fix its dtype) runs XLA's kernel in the program's dtype; ``convert`` rounds float ->
  narrower float with fpemu's kernel; ``exact`` (data movement, compares, selects, max/min, sorting)
  cannot round and runs on the program's own dtypes; ``call`` / ``cond`` / ``while`` / ``scan``
  recurse into their jaxprs.  With ``excess_precision`` (``jax_cpu``: XLA's default
  ``--xla_allow_excess_precision=true``) a bf16 result XLA computes in float32 is held unrounded
  (:class:`_Kept`): the upcasts the program states read its float32 value, every other reader the
  rounded one, rounded (and counted) on the first such read, so a value read only upcast is never
  rounded.  It travels into and out of jit calls, which XLA inlines.  Every other rounding to a format
  narrower than float32 goes through :func:`fpemu.formats.quantize` with the policy's rounding, overflow and subnormal modes, and every
  one is counted in the :class:`~fpemu.emulate.telemetry.Telemetry`.
* A floating equation whose primitive is not in the table is refused (FpemuInputError naming it, the
  module and the pass), never run silently; an equation without floating values cannot round and
  runs as JAX runs it.  Primitives whose floating results are float32 are listed in the telemetry.
* Module and pass come from each equation's ``source_info.name_stack``: flax.linen pushes the module
  path there (``Model/block_0/attn``), JAX wraps it in transform names (``jvp(...)``,
  ``transpose(jvp(...))``).  An equation under ``transpose`` is the backward pass; nested jaxprs'
  stacks are relative to the equation that calls them, so the interpreter prefixes them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import numpy as np
from jax.extend import core as jcore

from fpemu.emulate.policy import Policy, check_framework, get_policy
from fpemu.emulate.telemetry import ROOT, Telemetry
from fpemu.errors import FpemuInputError
from fpemu.formats import Format, get_format, quantize
from fpemu.steps.kernel import Kernel
from fpemu.steps.semantics import StepSemantics, get_semantics

F32 = np.float32
_FP16 = get_format("fp16")
_FP32 = get_format("fp32")

_EXACT = """reshape broadcast_in_dim transpose squeeze expand_dims concatenate slice dynamic_slice
    dynamic_update_slice gather pad rev select_n copy copy_p iota eq ne lt le gt ge is_finite neg abs sign
    max min reduce_max reduce_min argmax argmin stop_gradient sort floor ceil round clamp split
    sharding_constraint optimization_barrier nextafter reduce_and reduce_or and or not xor scatter
    select_and_gather_add reduce_precision pvary real imag bitcast_convert_type""".split()
_XLA = """exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan sinh cosh asinh acosh atanh
    sqrt rsqrt cbrt pow erf erfc erf_inv atan2 lgamma digamma igamma rem cumsum cumprod
    cumlogsumexp cummax cummin reduce_prod select_and_scatter_add reduce_window_sum conv_general_dilated""".split()
# Excess precision (StepSemantics.excess_precision, bf16 only: XLA:CPU upcasts every bf16 elementwise op, a
# dot and a convolution to float32 and rounds its result back; with --xla_allow_excess_precision=true the
# simplifier drops that rounding where the next op is an upcast the program itself asks for): the
# primitives JAX lowers (chlo decompositions) with an explicit float32 upcast of a bf16 input and an explicit
# rounding of the result (read their input in float32; their result is rounded), and those whose low dtype
# reducer rounds inside (their result is XLA's as it stands).  Found in jax 0.10.2's lowered and compiled
# HLO (docs/emulate.md).
_XLA_UPCASTING = ("erfc", "lgamma", "digamma", "erf_inv", "igamma", "sinh")
_XLA_REDUCING = ("cumsum", "cumprod", "cumlogsumexp", "cummax", "cummin", "reduce_prod", "select_and_scatter_add",
                 "reduce_window_sum")
_BF16 = np.dtype(jax.numpy.bfloat16)
# Primitives whose parameters fix their dtype (a scatter's update jaxpr): XLA's own kernel in the
# program's dtype, rounding as XLA does; the result is counted (a value XLA made inf counts as inf).
# Under a policy that rounds otherwise, the scatter runs in float32 (the lax function, which builds a
# float32 update jaxpr) and is rounded once by the policy.
_NATIVE = {"scatter-add": jax.lax.scatter_add, "scatter_add": jax.lax.scatter_add,
           "scatter-mul": jax.lax.scatter_mul, "scatter_mul": jax.lax.scatter_mul}
# arith primitive -> (the Kernel method computing it in float32, the numpy ufunc for float64)
_ARITH_OPS = {"add": ("add", np.add), "add_any": ("add", np.add), "sub": ("sub", np.subtract),
              "mul": ("mul", np.multiply), "div": ("div", np.divide)}
_ARITH = [*_ARITH_OPS, "square"]
# Primitives that JAX lowers (or XLA expands) into several ops of the program's dtype, each rounded:
# computed as that chain (``_chain`` names the recipe).
_CHAINS = ("integer_pow", "logistic")
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}
# The one table of how each primitive is placed (see the module docstring).
PRIMITIVES = {**{name: "exact" for name in _EXACT}, **{name: "xla" for name in _XLA},
              **{name: "native" for name in _NATIVE}, **{name: "chain" for name in _CHAINS},
              **{name: "arith" for name in _ARITH}, **{name: "call" for name in _CALLS},
              "dot_general": "dot", "reduce_sum": "reduce_sum", "convert_element_type": "convert",
              "cond": "cond", "while": "while", "scan": "scan"}
# The StepSemantics fields the interpreter applies to every program (the others model rewrites XLA
# makes across equations of the built-in step; the trace lists them as not applied).
APPLIED_SEMANTICS = ("flush_subnormals", "fp8_ops_in_fp16", "mean_by_reciprocal", "fma", "dot", "reduce",
                     "excess_precision")
DOT_ORDERS = ("xla_cpu", "sequential", "blas")
REDUCE_ORDERS = ("xla_cpu", "sequential", "pairwise")
# Name-stack segments JAX itself pushes (not modules; jnp.einsum also pushes its spec, "...qhd,...khd->...hqk").
_INTERNAL_SCOPES = ("rematted_computation",)
_TRANSFORM = re.compile(r"^[A-Za-z_]+\((.*)\)$")


def _host(value, dtype=None):
    """A value as the interpreter holds it: a numpy array, or for JAX's extended dtypes (typed PRNG
    keys, which numpy cannot hold and no rounding concerns) the JAX array itself."""
    if jax.dtypes.issubdtype(getattr(value, "dtype", None) or np.float32, jax.dtypes.extended):
        return value
    return np.asarray(value, dtype=dtype)


def _divides_by_reciprocal(eqn, semantics) -> bool:
    """Whether XLA computes this divide as a multiply by its divisor's reciprocal (StepSemantics'
    ``mean_by_reciprocal``): its algebraic simplifier rewrites A / constant and A / broadcast(B) so.  Measured
    (jax 0.10.2, XLA:CPU): a float32 array over a runtime scalar, or over a (rows, 1) divisor, equals
    ``x * (1 / s)`` on all of 100,000 elements and ``x / s`` on about half; a divisor of the result's shape
    divides.  (A runtime divisor is taken so for float32 results, the case measured; an optax Adam update's
    bias corrections divide so.)"""
    if eqn.primitive.name != "div" or not semantics.mean_by_reciprocal:
        return False
    divisor, result = eqn.invars[1], eqn.outvars[0].aval
    if isinstance(divisor, jcore.Literal):
        return True
    return np.dtype(result.dtype) == F32 and tuple(divisor.aval.shape) != tuple(result.shape)


@functools.lru_cache(maxsize=None)
def _is_float(dtype) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.floating)  # knows ml_dtypes' types (numpy's does not)


@functools.lru_cache(maxsize=4096)  # a program has few distinct stacks; every equation reads one
def parse_name_stack(stack: str) -> tuple:
    """(direction, module) of a name stack: ``transpose(jvp(M))/blk0/fc`` -> ``("backward", "M/blk0/fc")``.

    Example:
      >>> parse_name_stack("transpose(jvp(Model))/Dense_0")
      ('backward', 'Model/Dense_0')
    """
    direction = "backward" if "transpose(" in stack else "forward"
    parts = []
    for segment in stack.split("/"):
        match = _TRANSFORM.match(segment)
        while match:
            segment = match.group(1)
            match = _TRANSFORM.match(segment)
        if segment and segment not in _INTERNAL_SCOPES and "->" not in segment:  # "->": jnp.einsum's scope
            parts.append(segment)
    return direction, "/".join(parts) or ROOT


def rounding_counts(before: np.ndarray, after: np.ndarray, min_normal: float):
    """(counts in telemetry's COUNTERS order, 'overflow' / 'nan' / 'inf' / None) of rounding the float32
    ``before`` to ``after`` (numpy; the torch emulator's counts, same definitions)."""
    elements = before.size
    if not elements:
        return (0, 0, 0, 0, 0), None
    magnitude = np.abs(after)
    low, high = magnitude.min(), magnitude.max()
    if low >= min_normal and high < np.inf:  # all normal and finite (a NaN fails both compares)
        return (elements, 0, 0, 0, 0), None
    zero_after = magnitude == 0
    underflow = int(np.count_nonzero(zero_after & (before != 0)))
    subnormal = int(np.count_nonzero(~zero_after & (magnitude < min_normal)))
    finite_before = np.isfinite(before)
    overflow = int(np.count_nonzero(finite_before & ~np.isfinite(after)))
    nan_before = int(np.count_nonzero(np.isnan(before)))
    counts = (elements, underflow, subnormal, overflow, nan_before)
    if overflow:
        return counts, "overflow"
    if not np.all(finite_before):
        return counts, "nan" if nan_before else "inf"
    return counts, None


@dataclasses.dataclass(frozen=True)
class _Product:
    """A float32 multiply left for the add or sub that reads it (an FMA, rounded once)."""
    left: np.ndarray
    right: np.ndarray


class _Kept:
    """A bf16 result XLA keeps in float32 (excess precision): ``wide`` for the upcasts that read it, and its
    rounding, made by :meth:`_Interpreter.resolve` on the first other read (mutable so that it is made,
    and counted, once)."""

    __slots__ = ("wide", "dtype", "where", "kind", "rounded")

    def __init__(self, wide, dtype, where, kind):
        self.wide, self.dtype, self.where, self.kind, self.rounded = wide, dtype, where, kind, None


@dataclasses.dataclass(frozen=True)
class _Where:
    """The equation being evaluated: its primitive, pass and module (errors and telemetry name them)."""
    primitive: str
    direction: str
    module: str


class _Interpreter:
    """One emulation's state: policy, semantics, telemetry, the rounding stream."""

    def __init__(self, policy: Policy, semantics: StepSemantics, telemetry: Telemetry):
        self.policy, self.semantics, self.telemetry = policy, semantics, telemetry
        self.kernel = Kernel(semantics, _FP32)
        self.rounding_calls = 0
        self.where = None  # the equation being evaluated
        self._fusions = {}  # id(jaxpr) -> (jaxpr, ids of its contracted multiplies)
        # XLA's own low-precision kernels round so; another policy cannot use them
        self.policy_is_xla_rounding = (policy.rounding, policy.overflow, policy.subnormals) == ("nearest_even", "inf",
                                                                                                 True)
        for field, value, orders in (("dot", semantics.dot, DOT_ORDERS), ("reduce", semantics.reduce, REDUCE_ORDERS)):
            if value not in orders:
                raise FpemuInputError(f"semantics {semantics.name}: {field} order {value!r} is not one the JAX "
                                      f"interpreter computes; it computes {', '.join(orders)}")

    # -- jaxprs ---------------------------------------------------------------
    def run(self, jaxpr, consts, args, stack: str = "") -> list:
        env = {}

        def read(var):
            if isinstance(var, jcore.Literal):
                return np.asarray(var.val, dtype=var.aval.dtype)
            return env[var]

        for var, value in zip(jaxpr.constvars, consts):
            env[var] = self._hold(value)
        for var, value in zip(jaxpr.invars, args):
            env[var] = value
        fused = self._fused_products(jaxpr) if self.semantics.fma else ()
        for eqn in jaxpr.eqns:
            if id(eqn) in fused:  # a float32 multiply the add or sub reading it contracts into an FMA
                env[eqn.outvars[0]] = _Product(*self._factors(eqn, [self._widen(read(v)) for v in eqn.invars]))
                continue
            inner = str(eqn.source_info.name_stack)
            full = "/".join(part for part in (stack, inner) if part)
            args = [read(v) for v in eqn.invars]
            if any(isinstance(a, _Kept) for a in args):
                args = [self._as_read_by(eqn, a) for a in args]
            outs = self.equation(eqn, args, full)
            for var, value in zip(eqn.outvars, outs):
                env[var] = value
        return [read(v) for v in jaxpr.outvars]

    @staticmethod
    def _hold(value):
        """A jaxpr constant as this evaluator holds it (the compiled emulator's are tracers)."""
        return _host(value)

    def _as_read_by(self, eqn, value):
        """A :class:`_Kept` value as ``eqn`` reads it: a jit call (which XLA inlines) or a move XLA deletes
        takes it as it is, an upcast the program states its float32 value, any other reader its rounding."""
        if not isinstance(value, _Kept) or PRIMITIVES.get(eqn.primitive.name) == "call" or _moves_nothing(eqn):
            return value
        return value.wide if _reads_float32(eqn) else self.resolve(value)

    def resolve(self, value):
        """A value as an ordinary reader reads it: a :class:`_Kept` value rounded (once, and counted)."""
        if not isinstance(value, _Kept):
            return value
        if value.rounded is None:
            value.rounded = self.round(value.wide, value.dtype, value.where, value.kind)
        return value.rounded

    def _fused_products(self, jaxpr) -> set:
        """ids of the float32 multiplies that LLVM contracts with the one add or sub reading them (XLA
        sets ``AllowFPOpFusion=Fast``): StepSemantics' ``fma``, as in the step's ``p - lr * g``."""
        hit = self._fusions.get(id(jaxpr))
        if hit is None:
            uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jcore.Literal))
            uses.update(v for v in jaxpr.outvars if not isinstance(v, jcore.Literal))
            products, fused = {}, set()
            for eqn in jaxpr.eqns:
                single = eqn.outvars[0].aval.dtype == F32 if eqn.outvars else False
                if eqn.primitive.name in ("add", "add_any", "sub") and single:
                    source = next((products[v] for v in eqn.invars
                                   if not isinstance(v, jcore.Literal) and v in products and uses[v] == 1), None)
                    if source is not None:
                        fused.add(source)
                elif (eqn.primitive.name == "mul" or _divides_by_reciprocal(eqn, self.semantics)) and single:
                    products[eqn.outvars[0]] = id(eqn)
            hit = self._fusions[id(jaxpr)] = (jaxpr, fused)  # the jaxpr kept alive: its id stays its own
        return hit[1]

    def run_closed(self, closed, args, stack: str, inlined: bool = False) -> list:
        """A nested jaxpr's results; kept values leave it only when XLA ``inlined`` it (a jit call), not
        from a loop body or a branch (their own computations, whose results are materialized)."""
        if isinstance(closed, jcore.ClosedJaxpr):
            outs = self.run(closed.jaxpr, closed.consts, args, stack)
        else:
            outs = self.run(closed, [], args, stack)  # remat's open jaxpr
        return outs if inlined else [self.resolve(o) for o in outs]

    # -- one equation ------------------------------------------------------------
    def equation(self, eqn, args, stack: str) -> list:
        name = eqn.primitive.name
        direction, module = parse_name_stack(stack)
        where = self.where = _Where(name, direction, module)
        self.telemetry.location = module
        kind = PRIMITIVES.get(name)
        if kind in ("call", "cond", "while", "scan"):
            return getattr(self, f"_{kind}")(eqn, args, stack)
        avals = [v.aval for v in eqn.invars] + [v.aval for v in eqn.outvars]
        if not any(_is_float(getattr(a, "dtype", np.int32)) for a in avals):
            return self._bind(eqn, args)  # no floating value: nothing to round, JAX's own result
        if kind is None:
            raise FpemuInputError(
                f"emulate_jax cannot place primitive {name!r} (module {module}, {direction} pass): it is not in "
                "the interpreter's table fpemu.emulate._jax_interpreter.PRIMITIVES, so how it rounds is unknown")
        if kind == "exact":
            if args and isinstance(args[0], _Kept):  # a move XLA deletes (_moves_nothing): still kept
                kept = args[0]
                return [_Kept(self._bind(eqn, [kept.wide])[0], kept.dtype, kept.where, kept.kind)]
            return self._bind(eqn, args)
        exact = getattr(self, f"_{kind}")(eqn, args)
        if self.semantics.excess_precision and _rounds_in_float32(eqn):  # rounded where read rounded
            return [_Kept(exact[0], eqn.outvars[0].aval.dtype, where, kind)]
        return [self.round(value, var.aval.dtype, where, kind) for value, var in zip(exact, eqn.outvars)]

    def _bind(self, eqn, args) -> list:
        result = eqn.primitive.bind(*args, **eqn.params)
        results = result if eqn.primitive.multiple_results else [result]
        return [_host(r) for r in results]

    @staticmethod
    def _widen(value):
        value = np.asarray(value)
        return value.astype(F32) if _is_float(value.dtype) and value.dtype.itemsize < 4 else value

    # -- kinds that compute (each returns float32 values, or wider, for round) ---
    def _factors(self, eqn, values) -> list:
        """The two factors of a multiply, or of a divide XLA computes as one (_divides_by_reciprocal)."""
        if eqn.primitive.name != "div":
            return values
        return [values[0], self._reciprocal(values[1])]

    @staticmethod
    def _reciprocal(value):
        """1 / value rounded once to its dtype (a float64 quotient rounds to float32 as a float32 one would)."""
        value = np.asarray(value)
        return (1.0 / value.astype(np.float64)).astype(value.dtype)

    def _arith(self, eqn, args) -> list:
        name = eqn.primitive.name
        product = next((i for i, x in enumerate(args) if isinstance(x, _Product)), None)
        if product is not None:
            return [self._fma(name, args, product)]
        a = [self._widen(x) for x in args]
        if name == "square":
            a, name = [a[0], a[0]], "mul"
        if _divides_by_reciprocal(eqn, self.semantics):
            a, name = self._factors(eqn, a), "mul"
        method, ufunc = _ARITH_OPS[name]
        if a[0].dtype == np.float64:  # x64 programs: IEEE float64, no flush
            with np.errstate(all="ignore"):
                return [ufunc(a[0], a[1])]
        return [getattr(self.kernel, method)(a[0], a[1])]

    def _fma(self, name: str, args, index: int):
        """add / sub of a contracted product (``args[index]``) and the other operand, rounded once."""
        a, b = args[index].left, args[index].right
        other = self._widen(args[1 - index])
        if name == "sub":  # p - a * b = fma(-a, b, p); a * b - c = fma(a, b, -c)
            return self.kernel.fma(-a, b, other) if index == 1 else self.kernel.fma(a, b, -other)
        return self.kernel.fma(a, b, other)

    def _chain(self, eqn, args) -> list:
        """integer_pow as JAX lowers it (square-and-multiply, every multiply in the program's dtype) and
        logistic as XLA expands it (1 / (1 + exp(-x)) in the program's dtype): each step rounded, the
        last by :meth:`round`."""
        dtype = eqn.outvars[0].aval.dtype
        step = (lambda v: v) if np.dtype(dtype) == F32 else (lambda v: self._quantize(v, get_format(dtype)))
        k, x = self.kernel, self._widen(args[0])
        if eqn.primitive.name == "logistic":
            return [k.div(F32(1), step(k.add(step(self._xla_f32(jax.lax.exp_p, -x)), F32(1))))]
        power, acc, unrounded = abs(eqn.params["y"]), None, False
        if power == 0:
            return [np.ones_like(x)]
        while power:  # the last product is left to round (excess precision may keep it in float32)
            if power & 1:
                acc, unrounded = (x, False) if acc is None else (k.mul(step(acc) if unrounded else acc, x), True)
            power >>= 1
            if power:
                x = step(k.mul(x, x))
        if eqn.params["y"] < 0:
            return [k.div(F32(1), step(acc) if unrounded else acc)]
        return [acc]

    @staticmethod
    def _xla_f32(primitive, value):
        return np.asarray(primitive.bind(value, accuracy=None))

    def _native(self, eqn, args) -> list:
        low = np.dtype(eqn.outvars[0].aval.dtype).itemsize < 4
        if low and not self.policy_is_xla_rounding:
            operand, indices, updates = args
            p = eqn.params
            return [np.asarray(_NATIVE[eqn.primitive.name](
                self._widen(operand), indices, self._widen(updates), p["dimension_numbers"],
                indices_are_sorted=p["indices_are_sorted"], unique_indices=p["unique_indices"], mode=p["mode"]))]
        outs = self._bind(eqn, args)
        if low:
            wide = outs[0].astype(F32)
            self._count(wide, wide, get_format(outs[0].dtype), self.where)
        return outs

    def _xla(self, eqn, args) -> list:
        params = eqn.params
        if params.get("preferred_element_type") is not None:  # a convolution: accumulate and return float32
            params = {**params, "preferred_element_type": np.dtype(F32)}
        result = eqn.primitive.bind(*(self._widen(x) for x in args), **params)
        return [_host(r) for r in (result if eqn.primitive.multiple_results else [result])]

    def _dot(self, eqn, args) -> list:
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
        lhs, rhs = (self._widen(x) for x in args)
        if lhs.dtype != F32 or rhs.dtype != F32:
            return [np.asarray(jax.lax.dot_general_p.bind(lhs, rhs, **eqn.params))]
        if self.semantics.dot == "xla_cpu":  # XLA's float32 dot (its order), rounded once by fpemu
            params = {**eqn.params, "preferred_element_type": np.dtype(F32)}
            return [np.asarray(jax.lax.dot_general_p.bind(lhs, rhs, **params))]
        a = _matrix_layout(lhs, lhs_batch, lhs_contract)  # (B, M, K)
        b = _matrix_layout(rhs, rhs_batch, rhs_contract)  # (B, N, K)
        shape = eqn.outvars[0].aval.shape
        if self.semantics.dot == "blas":
            return [np.matmul(a, np.swapaxes(b, 1, 2)).reshape(shape)]
        k = self.kernel
        acc = np.zeros((a.shape[0], a.shape[1], b.shape[1]), F32)
        for index in range(a.shape[2]):  # from +0 over the contraction, in its order
            acc = k.add(acc, k.mul(a[:, :, index, None], b[:, None, :, index]))
        return [acc.reshape(shape)]

    def _reduce_sum(self, eqn, args) -> list:
        value = self._widen(args[0])
        axes = tuple(eqn.params["axes"])
        if value.dtype != F32:
            return [np.asarray(jax.lax.reduce_sum_p.bind(value, **eqn.params))]
        if self.semantics.reduce == "xla_cpu":
            return [self._xla_native(eqn, args, lambda: np.sum(value.astype(np.float64), axis=axes))]
        if self.semantics.reduce == "pairwise":
            return [np.sum(value, axis=axes, dtype=F32)]
        kept = [i for i in range(value.ndim) if i not in axes]
        moved = np.transpose(value, kept + list(axes)).reshape([value.shape[i] for i in kept] + [-1])
        if moved.shape[-1] == 0:
            return [np.zeros(moved.shape[:-1], F32)]
        if self.semantics.flush_subnormals:
            total = np.zeros(moved.shape[:-1], F32)
            for index in range(moved.shape[-1]):
                total = self.kernel.add(total, moved[..., index])
            return [total]
        # numpy's accumulate is strictly sequential; + 0.0 makes the start +0 (an all -0 sum is +0).
        with np.errstate(all="ignore"):
            return [np.add.accumulate(moved, axis=-1, dtype=F32)[..., -1] + F32(0)]

    def _xla_native(self, eqn, args, reference):
        """XLA's own kernel on the program's dtypes (its order; a bf16 / f16 reduce keeps a reducer of
        that dtype, rounding every partial sum), counted against ``reference()``, the result in float64.
        Under a policy that rounds otherwise than XLA, that reference is returned, for :meth:`round` to
        round once with the policy."""
        low = np.dtype(eqn.outvars[0].aval.dtype) != F32
        if low and not self.policy_is_xla_rounding:
            return reference()
        result = np.asarray(eqn.primitive.bind(*args, **eqn.params))
        if low:
            with np.errstate(all="ignore"):
                self._count(reference(), result.astype(F32), get_format(result.dtype), self.where)
        return result

    def _convert(self, eqn, args) -> list:
        value = np.asarray(args[0])
        if not _is_float(value.dtype):
            value = self._bind(eqn, args)[0] if not _is_float(eqn.params["new_dtype"]) else value.astype(F32)
        return [self._widen(value)]

    # -- rounding -----------------------------------------------------------------
    def round(self, value, dtype, where: _Where, kind: str):
        """``value`` (float32 or wider, or already of ``dtype``) as ``dtype``, rounded by fpemu's kernel
        when ``dtype`` is a floating format narrower than the value, and counted."""
        dtype, value = np.dtype(dtype), np.asarray(value)
        if not _is_float(dtype) or not _is_float(value.dtype):
            return value.astype(dtype)
        if dtype.itemsize >= value.dtype.itemsize:
            if dtype == F32:
                self.telemetry.left_in_float32(where.primitive)
            return value.astype(dtype)
        fmt = get_format(dtype)
        source = value if value.dtype in (np.float32, np.float64) else value.astype(F32)
        if kind != "convert" and self.semantics.fp8_ops_in_fp16 and fmt.bits == 8:
            source = self._quantize(source, _FP16)  # XLA:CPU computes fp8 ops in f16
        rounded = self._quantize(source, fmt)
        self._count(source, rounded, fmt, where)
        return rounded.astype(dtype)

    def _count(self, source, rounded, fmt: Format, where: _Where) -> None:
        counts, nonfinite = rounding_counts(source, rounded, fmt.min_normal)
        self.telemetry.record(where.direction, where.primitive, where.module, counts, nonfinite)

    def _quantize(self, values, fmt: Format):
        policy = self.policy
        self.rounding_calls += 1
        seed = (policy.seed << 32) + self.rounding_calls if policy.rounding == "stochastic" else None
        return quantize(values, fmt, rounding=policy.rounding, overflow=policy.overflow,
                        subnormals=policy.subnormals, seed=seed)

    # -- control flow -----------------------------------------------------------------
    def _call(self, eqn, args, stack: str) -> list:
        return self.run_closed(eqn.params[_CALLS[eqn.primitive.name]], args, stack, inlined=True)

    def _cond(self, eqn, args, stack: str) -> list:
        branches = eqn.params["branches"]
        index = int(np.clip(int(np.asarray(args[0])), 0, len(branches) - 1))
        return self.run_closed(branches[index], args[1:], stack)

    def _while(self, eqn, args, stack: str) -> list:
        p = eqn.params
        split = p["cond_nconsts"] + p["body_nconsts"]
        cond_consts, body_consts, carry = args[:p["cond_nconsts"]], args[p["cond_nconsts"]:split], list(args[split:])
        while bool(np.asarray(self.run_closed(p["cond_jaxpr"], [*cond_consts, *carry], stack)[0])):
            carry = self.run_closed(p["body_jaxpr"], [*body_consts, *carry], stack)
        return carry

    def _scan(self, eqn, args, stack: str) -> list:
        p = eqn.params
        consts, carry = args[:p["num_consts"]], list(args[p["num_consts"]:p["num_consts"] + p["num_carry"]])
        xs = args[p["num_consts"] + p["num_carry"]:]
        order = range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"])
        ys = {}
        for index in order:
            outs = self.run_closed(p["jaxpr"], [*consts, *carry, *(x[index] for x in xs)], stack)
            carry, ys[index] = outs[:p["num_carry"]], outs[p["num_carry"]:]
        stacked = []
        for position, var in enumerate(eqn.outvars[p["num_carry"]:]):
            stacked.append(np.stack([ys[i][position] for i in range(p["length"])]) if p["length"]
                           else np.zeros(var.aval.shape, var.aval.dtype))
        return [*carry, *stacked]


def _rounds_in_float32(eqn) -> bool:
    """Whether XLA:CPU computes this equation's one bf16 result in float32 and rounds it by a convert of
    its own (the convert excess precision may drop)."""
    name = eqn.primitive.name
    kind = PRIMITIVES.get(name)
    if len(eqn.outvars) != 1 or np.dtype(eqn.outvars[0].aval.dtype) != _BF16:
        return False
    return kind in ("arith", "dot", "chain") or kind == "xla" and name not in _XLA_UPCASTING + _XLA_REDUCING


def _moves_nothing(eqn) -> bool:
    """A transpose, reshape or copy whose result has its operand's shape (a transpose of unit dims): XLA's
    simplifier deletes it, so a rounding before it and an upcast after it meet (a 1x1 weight gradient)."""
    return (eqn.primitive.name in ("transpose", "reshape", "copy", "copy_p") and len(eqn.invars) == 1
            and eqn.invars[0].aval.shape == eqn.outvars[0].aval.shape)


def _reads_float32(eqn) -> bool:
    """Whether this equation upcasts its bf16 inputs to float32 as the program states it (a convert, or a
    primitive JAX lowers with one): a reader the simplifier folds with the rounding before it."""
    name = eqn.primitive.name
    if name == "convert_element_type":
        return np.dtype(eqn.params["new_dtype"]) == F32
    return name in _XLA_UPCASTING


def _matrix_layout(x: np.ndarray, batch, contract) -> np.ndarray:
    """x with its batch dims first, free dims next, contracted dims last, as (B, free, K)."""
    free = [i for i in range(x.ndim) if i not in batch and i not in contract]
    moved = np.transpose(x, list(batch) + free + list(contract))
    size = lambda dims: int(np.prod([x.shape[i] for i in dims], dtype=np.int64))
    return moved.reshape(size(batch), size(free), size(contract))


def semantics_record(semantics: StepSemantics) -> dict:
    """The semantics as the trace names it: its fields, and which the interpreter applies."""
    fields = dataclasses.asdict(semantics)
    return {"name": semantics.name, "applied": {f: fields[f] for f in APPLIED_SEMANTICS},
            "not_applied": sorted(f for f, v in fields.items()
                                  if f not in APPLIED_SEMANTICS and f != "name" and v not in (False, None))}


def primitive_table(semantics) -> dict:
    """The placement table and the semantics as a trace records them (its ``op_table``)."""
    kinds = {}
    for name, kind in sorted(PRIMITIVES.items()):
        kinds.setdefault(kind, []).append(name)
    return {"jax": jax.__version__, "primitives": kinds, "semantics": semantics_record(get_semantics(semantics))}


class JaxEmulation:
    """A function emulated: call it like the function; its telemetry accumulates over calls.

    Attributes:
      policy, semantics, telemetry: as given to :func:`emulate_jax`.
    """

    def __init__(self, fn, policy: Policy, semantics: StepSemantics, telemetry: Telemetry, static_argnums):
        self.fn, self.policy, self.semantics, self.telemetry = fn, policy, semantics, telemetry
        self.static_argnums = tuple(static_argnums)
        self._interpreter = _Interpreter(policy, semantics, telemetry)
        self._traced = {}

    def jaxpr(self, *args):
        """(ClosedJaxpr, output tree) of the function for these arguments (traced once per signature)."""
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        key = (tree, tuple(_signature(x) for x in leaves),
               tuple(args[i] for i in self.static_argnums))
        hit = self._traced.get(key)
        if hit is None:
            closed, shapes = jax.make_jaxpr(self.fn, static_argnums=self.static_argnums, return_shape=True)(*args)
            hit = self._traced[key] = (closed, jax.tree_util.tree_structure(shapes))
        return hit

    def __call__(self, *args):
        closed, out_tree = self.jaxpr(*args)
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        leaves = [_host(x, var.aval.dtype)
                  for x, var in zip(jax.tree_util.tree_leaves(dynamic), closed.jaxpr.invars)]
        outs = [self._interpreter.resolve(o) for o in self._interpreter.run(closed.jaxpr, closed.consts, leaves)]
        return jax.tree_util.tree_unflatten(out_tree, [jax.numpy.asarray(o) for o in outs])


def _signature(x) -> tuple:
    if isinstance(x, (bool, int, float, complex)):
        return (type(x).__name__,)
    return (tuple(np.shape(x)), str(x.dtype), bool(getattr(x, "weak_type", False)))


def emulate_jax(fn, policy="program", *, semantics="jax_cpu_strict", telemetry: Telemetry | None = None,
                static_argnums=(), **overrides) -> JaxEmulation:
    """``fn`` evaluated from its jaxpr, every result rounded by fpemu's kernel to the dtype the jaxpr gives it.

    Args:
      fn: a JAX function (a step, a loss, ``jax.value_and_grad(loss)``, a jitted function...).
      policy: a policy name (``fpemu.emulate.POLICIES``; JAX takes placement ``program``) or a
        :class:`Policy`: its rounding, overflow, subnormal modes and seed apply to every rounding.
      semantics: a :data:`fpemu.steps.SEMANTICS` preset or :class:`StepSemantics`: the float32
        arithmetic (``jax_cpu_strict``, default: XLA:CPU's FTZ/DAZ, its own dot and reduce kernels;
        ``seed``: IEEE arithmetic, sequential dot and sum).  ``APPLIED_SEMANTICS`` lists the fields applied.
      telemetry: the :class:`Telemetry` to write into (a new one if None).
      static_argnums: as ``jax.jit``'s.
      overrides: Policy fields to replace (``rounding="stochastic"``, ``subnormals=False``, ...).

    Returns:
      A :class:`JaxEmulation`: call it as ``fn``; its outputs are jax arrays of the jaxpr's dtypes.

    Raises:
      FpemuInputError: a primitive the interpreter cannot place (named with its module and pass),
        a policy JAX does not take, an order the interpreter does not compute.

    Example:
      >>> import jax.numpy as jnp
      >>> double = emulate_jax(lambda x: (x * 3.0).astype(jnp.bfloat16) * 2)
      >>> [float(v) for v in double(jnp.array([1.01, 2.0]))]
      [6.0625, 12.0]
    """
    policy = get_policy(policy, **overrides)
    check_framework(policy, "jax")
    if policy.accumulation != "fp32":
        raise FpemuInputError(f"policy {policy.name}: accumulation {policy.accumulation!r} is torch's; the JAX "
                              "interpreter accumulates in float32 in the semantics' dot and reduce orders")
    try:
        semantics = get_semantics(semantics)
    except (TypeError, ValueError) as error:
        raise FpemuInputError(f"semantics: {error}") from None
    return JaxEmulation(fn, policy, semantics, telemetry if telemetry is not None else Telemetry(), static_argnums)
