"""The compiled JAX emulator: the jaxpr re-traced under ``jax.jit`` into one program in which every
low-precision result is computed in float32 and rounded once by fpemu's kernel as jax integer ops
(:mod:`fpemu.emulate._jax_rounding`), the telemetry counted inside the program.

How it works (the WHY of each part):

* :class:`_Compiler` is the interpreter (:class:`~fpemu.emulate._jax_interpreter._Interpreter`) run on
  tracers: the same placement table, the same excess-precision bookkeeping (a kept value is rounded
  where an ordinary reader reads it, decided while tracing), the same FMA rule; only the arithmetic
  is emitted as XLA ops instead of being run one XLA call (or numpy pass) at a time.
* Its float32 arithmetic is XLA:CPU's own (FTZ/DAZ, its dot, convolution and reduce kernels, LLVM's
  contraction of a multiply into the add reading it), so it takes the semantics whose arithmetic that
  is (``COMPILED_SEMANTICS``: ``flush_subnormals``, ``fma``, ``dot`` and ``reduce`` ``xla_cpu``).  A
  float32 multiply the interpreter does not contract, read by an add, is put behind an
  ``optimization_barrier`` so that LLVM cannot contract it either.
* Each rounding is a *site*: (pass, primitive, module), known while tracing; the program returns,
  per site, how often it ran, its five counts and the clock of its first inf/NaN (a counter of
  roundings threaded through the program, through loop carries and branches), so the host replays
  the sites into the :class:`~fpemu.emulate.telemetry.Telemetry` in the interpreter's order and
  picks each pass's first non-finite result as the interpreter does.
* Opt-in (``compiled=None`` or ``True``; the default stays the interpreter: docs/emulate.md says why).
  What the program cannot compute as the interpreter does is refused while tracing (``NotCompiled``
  naming why) and, unless ``compiled=True`` was asked for, run by the interpreter instead: stochastic
  rounding (the interpreter draws a seeded numpy stream per rounding call), a low-precision
  reduce_sum under a policy that rounds otherwise than XLA (its reference sum is float64), float64
  values (``jax_enable_x64``), a while loop whose condition rounds, formats the uint32 kernel does
  not take.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from fpemu.emulate import _jax_rounding
from fpemu.emulate._jax_interpreter import (_FP16, _NATIVE, F32, JaxEmulation, _Interpreter, _divides_by_reciprocal,
                                            _is_float, _Kept, _Product, emulate_jax as interpreted)
from fpemu.emulate.telemetry import Telemetry
from fpemu.errors import FpemuInputError
from fpemu.formats import Format, get_format
from fpemu.steps.semantics import StepSemantics

# The StepSemantics fields whose values are XLA:CPU's own arithmetic (the program runs it).
COMPILED_SEMANTICS = {"flush_subnormals": True, "fma": True, "dot": "xla_cpu", "reduce": "xla_cpu"}
# A site's row: hits, the five counts (telemetry's COUNTERS), the clock of its first non-finite result, its kind.
_ROW = 8
_NEVER = np.iinfo(np.int32).max
_NONFINITE = (None, "overflow", "nan", "inf")
_MULTIPLIES = ("mul", "square", "integer_pow", "div")
_ADDS = ("add", "add_any", "sub")


class NotCompiled(Exception):
    """What the compiled program cannot compute as the interpreter does (the interpreter runs it)."""


def compile_refusal(policy, semantics: StepSemantics):
    """Why this policy and semantics cannot be compiled, or None."""
    for field, value in COMPILED_SEMANTICS.items():
        if getattr(semantics, field) != value:
            return (f"semantics {semantics.name}: {field}={getattr(semantics, field)!r}; the compiled program runs "
                    f"XLA:CPU's arithmetic ({field}={value!r})")
    if policy.rounding == "stochastic":
        return "stochastic rounding draws a seeded numpy stream per rounding call (the interpreter's)"
    if jax.config.jax_enable_x64:
        return "jax_enable_x64: float64 values round in float64 arithmetic"
    return None


@dataclasses.dataclass
class _Tally:
    """The sites of one traced (sub)program: their keys (static) and rows (traced), and the clock."""
    clock: object
    keys: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)

    def stacked(self):
        return jnp.stack(self.rows) if self.rows else jnp.zeros((0, _ROW), jnp.int32)


def _empty_rows(count: int):
    rows = jnp.zeros((count, _ROW), jnp.int32)
    return rows.at[:, 6].set(_NEVER)


def _merged(acc, rows):
    """Rows of one loop iteration added to the rows so far: hits and counts summed, the first non-finite
    result the earlier one."""
    earlier = rows[:, 6] < acc[:, 6]
    first = jnp.where(earlier, rows[:, 6], acc[:, 6])
    kind = jnp.where(earlier, rows[:, 7], acc[:, 7])
    return jnp.concatenate([acc[:, :6] + rows[:, :6], first[:, None], kind[:, None]], axis=1)


def _u32(value):
    return jax.lax.bitcast_convert_type(value, jnp.uint32)


class _Compiler(_Interpreter):
    """The interpreter on tracers: one emulation traced into one program."""

    def __init__(self, policy, semantics, telemetry):
        super().__init__(policy, semantics, telemetry)
        self.tally = None
        self.float32_ops = set()
        self._barriers = {}  # id(jaxpr) -> (jaxpr, ids of the float32 multiplies kept from contraction)
        self._barrier_eqns = set()

    # -- sites ---------------------------------------------------------------------
    def _record(self, where, counts, kind) -> None:
        tally = self.tally
        clock = tally.clock
        tally.clock = clock + 1
        first = jnp.where(kind > 0, clock, _NEVER)
        tally.keys.append((where.direction, where.primitive, where.module))
        tally.rows.append(jnp.stack([jnp.int32(1), *counts, first, kind]).astype(jnp.int32))

    def _traced(self, fn, clock):
        """fn() run under a fresh tally from ``clock``: (its results, the tally)."""
        outer, self.tally = self.tally, _Tally(clock)
        try:
            return fn(), self.tally
        finally:
            self.tally = outer

    def _site_keys(self, fn, *args) -> list:
        """The sites ``fn(*args)`` records (traced aside, its program dropped): a loop's or branch's rows are
        laid out before the loop is built."""
        found = []

        def probe(*values):
            _, tally = self._traced(lambda: fn(*values), jnp.int32(0))
            found.extend(tally.keys)
            return 0
        jax.make_jaxpr(probe)(*args)
        return found

    def left_in_float32(self, primitive: str) -> None:
        self.float32_ops.add(primitive)

    # -- values --------------------------------------------------------------------
    def run(self, jaxpr, consts, args, stack: str = "") -> list:
        self._barrier_eqns.update(self._barrier_ids(jaxpr))
        return super().run(jaxpr, consts, args, stack)

    def equation(self, eqn, args, stack: str) -> list:
        outs = super().equation(eqn, args, stack)
        if id(eqn) in self._barrier_eqns:
            outs = [jax.lax.optimization_barrier(o) for o in outs]
        return outs

    def _as_read_by(self, eqn, value):
        """As the interpreter's; the float32 value of a kept result, read by an upcast, is kept from LLVM's
        contraction with an add after it (the interpreter computes that add on its own)."""
        read = super()._as_read_by(eqn, value)
        return jax.lax.optimization_barrier(read) if isinstance(value, _Kept) and read is value.wide else read

    def _barrier_ids(self, jaxpr) -> set:
        """ids of the float32 multiplies (and divides, which mean_by_reciprocal makes multiplies) read by an add
        that the interpreter does not contract: XLA would."""
        hit = self._barriers.get(id(jaxpr))
        if hit is None:
            fused = self._fused_products(jaxpr) if self.semantics.fma else set()
            added = {v for e in jaxpr.eqns if e.primitive.name in _ADDS for v in e.invars
                     if not isinstance(v, jcore.Literal)}
            ids = {id(e) for e in jaxpr.eqns if e.primitive.name in _MULTIPLIES and id(e) not in fused
                   and len(e.outvars) == 1 and e.outvars[0].aval.dtype == F32 and e.outvars[0] in added}
            hit = self._barriers[id(jaxpr)] = (jaxpr, ids)  # the jaxpr kept alive: its id stays its own
        return hit[1]

    @staticmethod
    def _hold(value):
        return value

    def _bind(self, eqn, args) -> list:
        result = eqn.primitive.bind(*args, **eqn.params)
        return list(result) if eqn.primitive.multiple_results else [result]

    @staticmethod
    def _widen(value):
        dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else None
        if dtype is not None and _is_float(dtype):
            if dtype.itemsize > 4:
                raise NotCompiled("a float64 value (jax_enable_x64)")
            if dtype.itemsize < 4:
                return jnp.asarray(value).astype(F32)
        return value

    # -- kinds ---------------------------------------------------------------------
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
        op = {"add": jax.lax.add, "add_any": jax.lax.add, "sub": jax.lax.sub, "mul": jax.lax.mul,
              "div": jax.lax.div}[name]
        return [op(*(jnp.asarray(v, F32) for v in a))]

    @staticmethod
    def _reciprocal(value):
        """1 / value: a constant's folded here as the interpreter folds it, a traced one by XLA's float32 divide."""
        if isinstance(value, (np.ndarray, np.generic, float)):
            return (1.0 / np.asarray(value, np.float64)).astype(F32)
        return jnp.float32(1) / jnp.asarray(value, F32)

    def _fma(self, name: str, args, index: int):
        """The contracted multiply and its add, emitted as XLA:CPU contracts them (one FMA)."""
        a, b = args[index].left, args[index].right
        other = jnp.asarray(self._widen(args[1 - index]), F32)
        if name == "sub":
            return other - a * b if index == 1 else a * b - other
        return a * b + other

    def _chain(self, eqn, args) -> list:
        dtype = eqn.outvars[0].aval.dtype
        step = (lambda v: v) if np.dtype(dtype) == F32 else (lambda v: self._quantize(v, get_format(dtype)))
        x = jnp.asarray(self._widen(args[0]), F32)
        one = jnp.float32(1)
        if eqn.primitive.name == "logistic":
            return [one / step(step(jax.lax.exp_p.bind(-x, accuracy=None)) + one)]
        power, acc, unrounded = abs(eqn.params["y"]), None, False
        if power == 0:
            return [jnp.ones_like(x)]
        while power:
            if power & 1:
                acc, unrounded = (x, False) if acc is None else ((step(acc) if unrounded else acc) * x, True)
            power >>= 1
            if power:
                x = step(x * x)
        if eqn.params["y"] < 0:
            return [one / (step(acc) if unrounded else acc)]
        return [acc]

    def _native(self, eqn, args) -> list:
        low = np.dtype(eqn.outvars[0].aval.dtype).itemsize < 4
        if low and not self.policy_is_xla_rounding:
            operand, indices, updates = args
            p = eqn.params
            return [_NATIVE[eqn.primitive.name](
                self._widen(operand), indices, self._widen(updates), p["dimension_numbers"],
                indices_are_sorted=p["indices_are_sorted"], unique_indices=p["unique_indices"], mode=p["mode"])]
        outs = self._bind(eqn, args)
        if low:
            wide = outs[0].astype(F32)
            self._count(wide, wide, get_format(outs[0].dtype), self.where)
        return outs

    def _xla(self, eqn, args) -> list:
        params = eqn.params
        if params.get("preferred_element_type") is not None:
            params = {**params, "preferred_element_type": np.dtype(F32)}
        result = eqn.primitive.bind(*(self._widen(x) for x in args), **params)
        return list(result) if eqn.primitive.multiple_results else [result]

    def _dot(self, eqn, args) -> list:
        lhs, rhs = (self._widen(x) for x in args)
        if lhs.dtype != F32 or rhs.dtype != F32:
            return [jax.lax.dot_general_p.bind(lhs, rhs, **eqn.params)]
        return [jax.lax.dot_general_p.bind(lhs, rhs, **{**eqn.params, "preferred_element_type": np.dtype(F32)})]

    def _reduce_sum(self, eqn, args) -> list:
        value = self._widen(args[0])
        if value.dtype != F32:
            return [jax.lax.reduce_sum_p.bind(value, **eqn.params)]
        reduce = functools.partial(eqn.primitive.bind, **eqn.params)
        if np.dtype(eqn.outvars[0].aval.dtype) == F32:
            return [_standalone(reduce, args[0])]
        if not self.policy_is_xla_rounding:
            raise NotCompiled("a low-precision reduce_sum under a policy rounding otherwise than XLA (the interpreter "
                              "rounds its float64 sum)")
        result = _standalone(reduce, args[0])  # XLA's reducer in the program's dtype
        self._count_sum(value, tuple(eqn.params["axes"]), result.astype(F32), get_format(result.dtype))
        return [result]

    def _convert(self, eqn, args) -> list:
        value = args[0]
        if not _is_float(np.dtype(value.dtype)):
            value = self._bind(eqn, args)[0] if not _is_float(eqn.params["new_dtype"]) else value.astype(F32)
        return [self._widen(value)]

    # -- rounding ------------------------------------------------------------------
    def round(self, value, dtype, where, kind: str):
        dtype, value = np.dtype(dtype), jnp.asarray(value)
        source_dtype = np.dtype(value.dtype)
        if not _is_float(dtype) or not _is_float(source_dtype):
            return value.astype(dtype)
        if dtype.itemsize >= source_dtype.itemsize:
            if dtype == F32:
                self.left_in_float32(where.primitive)
            return value.astype(dtype)
        fmt = get_format(dtype)
        source = self._widen(value)
        if kind != "convert" and self.semantics.fp8_ops_in_fp16 and fmt.bits == 8:
            source = self._quantize(source, _FP16)
        rounded = self._quantize(source, fmt)
        self._count(source, rounded, fmt, where)
        return rounded.astype(dtype)  # exact: a value of fmt (XLA's converts keep subnormals)

    def _quantize(self, values, fmt: Format):
        if not _jax_rounding.supported(fmt):
            raise NotCompiled(f"format {fmt.name} rounds in float64 in fpemu's kernel")
        policy = self.policy
        self.rounding_calls += 1
        return _jax_rounding.round_to_format_jax(values, fmt, rounding=policy.rounding, overflow=policy.overflow,
                                                 subnormals=policy.subnormals)

    def _count(self, source, rounded, fmt: Format, where) -> None:
        """The interpreter's ``rounding_counts``, on bit patterns (a compare of floats would read a float32
        subnormal as zero under XLA:CPU's DAZ)."""
        before, after = _u32(source) & jnp.uint32(0x7FFFFFFF), _u32(rounded) & jnp.uint32(0x7FFFFFFF)
        finite_before = before < jnp.uint32(0x7F800000)
        nan_before = before > jnp.uint32(0x7F800000)
        self._counted(where, fmt, after, nonzero_before=before != 0, finite_before=finite_before,
                      nan_before=nan_before)

    def _count_sum(self, value, axes, result, fmt: Format) -> None:
        """Counts of XLA's low-precision reduce against the sum's reference: NaN where an element is NaN or
        infinities of both signs meet, infinite where an element is, zero where the float32 sum is (the
        interpreter's reference is the float64 sum: it can differ only where those are zero apart)."""
        bits = _u32(value)
        magnitude = bits & jnp.uint32(0x7FFFFFFF)
        positive_inf, negative_inf = bits == jnp.uint32(0x7F800000), bits == jnp.uint32(0xFF800000)
        nan = jnp.any(magnitude > jnp.uint32(0x7F800000), axes) | (jnp.any(positive_inf, axes)
                                                                  & jnp.any(negative_inf, axes))
        infinite = ~nan & jnp.any(positive_inf | negative_inf, axes)
        total = _u32(jnp.sum(value, axes)) & jnp.uint32(0x7FFFFFFF)
        after = _u32(result) & jnp.uint32(0x7FFFFFFF)
        self._counted(self.where, fmt, after, nonzero_before=(total != 0) | nan | infinite,
                      finite_before=~(nan | infinite), nan_before=nan)

    def _counted(self, where, fmt: Format, after, *, nonzero_before, finite_before, nan_before) -> None:
        min_normal = jnp.uint32(_jax_rounding.float32_bits(fmt.min_normal))
        # rounding_counts' shortcut: all normal and finite after rounding counts nothing (an infinite input
        # saturated to max finite included)
        plain = jnp.all((after >= min_normal) & (after < jnp.uint32(0x7F800000)))
        total = lambda flags: jnp.where(plain, 0, jnp.sum(flags, dtype=jnp.int32))  # noqa: E731
        zero_after = after == 0
        underflow = total(zero_after & nonzero_before)
        subnormal = total(~zero_after & (after < min_normal))
        overflow = total(finite_before & (after >= jnp.uint32(0x7F800000)))
        nans = total(nan_before)
        kind = jnp.where(overflow > 0, 1, jnp.where(plain | jnp.all(finite_before), 0, jnp.where(nans > 0, 2, 3)))
        self._record(where, (jnp.int32(after.size), underflow, subnormal, overflow, nans), kind)

    # -- control flow --------------------------------------------------------------
    def _cond(self, eqn, args, stack: str) -> list:
        branches = eqn.params["branches"]
        operands = args[1:]
        layouts = [self._site_keys(lambda *v, b=b: self.run_closed(b, list(v), stack), *operands) for b in branches]
        offsets = np.cumsum([0] + [len(keys) for keys in layouts])

        def branch(index):
            def run(clock, *values):
                outs, tally = self._traced(lambda: self.run_closed(branches[index], list(values), stack), clock)
                rows = _empty_rows(int(offsets[-1])).at[offsets[index]:offsets[index + 1]].set(tally.stacked())
                return tally.clock, rows, outs
            return run

        clock, rows, outs = jax.lax.switch(args[0], [branch(i) for i in range(len(branches))],
                                           self.tally.clock, *operands)
        self._adopt([key for keys in layouts for key in keys], rows, clock)
        return outs

    def _adopt(self, keys, rows, clock) -> None:
        self.tally.keys.extend(keys)
        self.tally.rows.extend(rows[i] for i in range(len(keys)))
        self.tally.clock = clock

    def _while(self, eqn, args, stack: str) -> list:
        p = eqn.params
        split = p["cond_nconsts"] + p["body_nconsts"]
        cond_consts, body_consts, carry = args[:p["cond_nconsts"]], args[p["cond_nconsts"]:split], list(args[split:])
        test = lambda values: self.run_closed(p["cond_jaxpr"], [*cond_consts, *values], stack)[0]  # noqa: E731
        if self._site_keys(lambda *v: test(list(v)), *carry):
            raise NotCompiled("a while loop whose condition rounds")
        body = lambda values: self.run_closed(p["body_jaxpr"], [*body_consts, *values], stack)  # noqa: E731
        keys = self._site_keys(lambda *v: body(list(v)), *carry)

        def step(state):
            clock, rows, values = state
            outs, tally = self._traced(lambda: body(list(values)), clock)
            return tally.clock, _merged(rows, tally.stacked()), outs

        start = (self.tally.clock, _empty_rows(len(keys)), carry)
        clock, rows, outs = jax.lax.while_loop(lambda state: test(list(state[2])), step, start)
        self._adopt(keys, rows, clock)
        return list(outs)

    def _scan(self, eqn, args, stack: str) -> list:
        p = eqn.params
        consts, carry = args[:p["num_consts"]], list(args[p["num_consts"]:p["num_consts"] + p["num_carry"]])
        xs = args[p["num_consts"] + p["num_carry"]:]
        body = lambda values, slices: self.run_closed(p["jaxpr"], [*consts, *values, *slices], stack)  # noqa: E731
        keys = self._site_keys(lambda c, s: body(list(c), list(s)), carry, [x[0] for x in xs]) if p["length"] else []

        def step(state, slices):
            clock, rows, values = state
            outs, tally = self._traced(lambda: body(list(values), list(slices)), clock)
            return (tally.clock, _merged(rows, tally.stacked()), outs[:p["num_carry"]]), outs[p["num_carry"]:]

        (clock, rows, carry), ys = jax.lax.scan(step, (self.tally.clock, _empty_rows(len(keys)), carry), list(xs),
                                                length=p["length"], reverse=p["reverse"])
        self._adopt(keys, rows, clock)
        return [*carry, *ys]


class CompiledEmulation(JaxEmulation):
    """:class:`JaxEmulation` run as one jitted program per signature (the interpreter where it cannot be).

    Attributes:
      compiled: True (compiled or refused), or None (compiled where it can be, else interpreted).
      last_path: ``compiled`` or ``interpreted``: how the last call ran.
      refusals: signature -> why the interpreter ran it.
    """

    def __init__(self, fn, policy, semantics, telemetry, static_argnums, compiled):
        super().__init__(fn, policy, semantics, telemetry, static_argnums)
        self.compiled = compiled
        self.last_path = None
        self.refusals = {}
        self._programs = {}

    def __call__(self, *args):
        closed, out_tree = self.jaxpr(*args)
        key = id(closed)
        refusal = self.refusals.get(key) or compile_refusal(self.policy, self.semantics)
        if refusal is None:
            try:
                return self._run_compiled(closed, out_tree, args)
            except NotCompiled as why:
                refusal = self.refusals[key] = str(why)
        if self.compiled:
            raise FpemuInputError(f"emulate_jax(compiled=True): cannot compile this program: {refusal}; "
                                  "compiled=None runs it in the interpreter")
        self.last_path = "interpreted"
        return super().__call__(*args)

    def _run_compiled(self, closed, out_tree, args):
        program = self._programs.get(id(closed))
        if program is None:
            program = self._programs[id(closed)] = _Program(closed, self.policy, self.semantics)
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        outs = program(self.telemetry, jax.tree_util.tree_leaves(dynamic))
        self.last_path = "compiled"
        return jax.tree_util.tree_unflatten(out_tree, outs)


def _standalone(fn, value):
    """``fn(value)`` as XLA:CPU computes it alone, as jit and the interpreter do: a reduce that XLA fuses with the
    rounding kernel making its operand sums in another order (41 of 60 random 8x16 float32 sums differed by an ulp
    or more, AVX2 host, jax 0.10.2), and XLA:CPU drops optimization barriers before it fuses.  A conditional's
    branch is a computation of its own, which nothing outside is fused into: both branches are ``fn``, under a
    predicate XLA cannot fold (a constant one it would)."""
    if value.size == 0:
        return fn(value)
    first = jax.lax.bitcast_convert_type(jnp.ravel(value)[0].astype(F32), jnp.int32)
    return jax.lax.cond(first >= 0, fn, fn, value)


class _Program:
    """One signature's jitted program and its sites (known once traced)."""

    def __init__(self, closed, policy, semantics):
        self.closed, self.policy, self.semantics = closed, policy, semantics
        self.keys, self.float32_ops, self.location = None, (), None
        self._jitted = jax.jit(self._trace)

    def _trace(self, consts, leaves):
        compiler = _Compiler(self.policy, self.semantics, Telemetry())
        outs, tally = compiler._traced(lambda: [compiler.resolve(o) for o in compiler.run(
            self.closed.jaxpr, consts, leaves)], jnp.int32(0))
        self.keys, self.float32_ops = tally.keys, tuple(sorted(compiler.float32_ops))
        self.location = compiler.telemetry.location
        return [jnp.asarray(o) for o in outs], tally.stacked()

    def __call__(self, telemetry: Telemetry, leaves) -> list:
        leaves = [jnp.asarray(x, var.aval.dtype) if not _extended(x) else x
                  for x, var in zip(leaves, self.closed.jaxpr.invars)]
        outs, rows = self._jitted(list(self.closed.consts), leaves)
        replay(telemetry, self.keys, np.asarray(rows), self.float32_ops)
        telemetry.location = self.location
        return outs


def _extended(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.extended)


def replay(telemetry: Telemetry, keys, rows: np.ndarray, float32_ops) -> None:
    """The sites' rows into ``telemetry`` as the interpreter records them: every site that ran, in program
    order, then each pass's first non-finite result (the least clock)."""
    for op in float32_ops:
        telemetry.left_in_float32(op)
    first = {}
    for (direction, op, module), row in zip(keys, rows):
        if not row[0]:
            continue  # a branch not taken, a loop run no times
        telemetry.record(direction, op, module, tuple(int(v) for v in row[1:6]))
        if row[7] and (direction not in first or row[6] < first[direction][0]):
            first[direction] = (int(row[6]), op, module, _NONFINITE[int(row[7])])
    for direction, (_, op, module, produced) in sorted(first.items(), key=lambda item: item[1][0]):
        telemetry.record(direction, op, module, (0, 0, 0, 0, 0), produced)


def emulate_jax(fn, policy="program", *, compiled=False, **kwargs) -> JaxEmulation:
    """:func:`fpemu.emulate._jax_interpreter.emulate_jax`, optionally compiled: ``compiled=None`` runs one jitted
    program per signature where it computes what the interpreter computes (module docstring), else the
    interpreter; ``True`` refuses (FpemuInputError naming why) what it cannot compile; ``False`` (default, until
    the flax example's trace is confirmed on the compiled path and its compile time is down) interprets.

    Example:
      >>> import jax.numpy as jnp
      >>> double = emulate_jax(lambda x: (x * 3.0).astype(jnp.bfloat16) * 2, compiled=None)
      >>> [float(v) for v in double(jnp.array([1.01, 2.0]))], double.last_path
      ([6.0625, 12.0], 'compiled')
    """
    if compiled not in (None, True, False):
        raise FpemuInputError(f"compiled must be None, True or False, got {compiled!r}")
    emulation = interpreted(fn, policy, **kwargs)
    if compiled is False:
        return emulation
    if compiled:
        refusal = compile_refusal(emulation.policy, emulation.semantics)
        if refusal:
            raise FpemuInputError(f"emulate_jax(compiled=True): {refusal}; compiled=None runs it in the interpreter")
    return CompiledEmulation(emulation.fn, emulation.policy, emulation.semantics, emulation.telemetry,
                             emulation.static_argnums, compiled)
