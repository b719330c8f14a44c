"""Every op torch's autocast tables place, emulated and compared with torch CPU op by op (torch 2.13.0).

For each op of the AutocastCPU and AutocastCUDA tables (``fpemu.emulate.op_table``), called as
``fpemu.emulate._op_samples`` says, under the table's policy:

- ``low``: the emulated result has the low dtype and equals torch CPU's own float16 / bfloat16
  kernel bit for bit, except the ops of ``MEASURED`` (their CPU kernels accumulate in another order
  or round intermediate results; the emulation computes in float32 and rounds once, as CUDA's
  kernels do): those stay within two epsilons of the format normwise, and benchmarks/emulate_ops.py
  writes their ulp histogram (reports/emulate_ops.md).  Where torch has no CPU kernel in the low
  format, only the placement is checked.
- ``fp32``: given low inputs, the result is float32 and equals torch's float32 kernel bit for bit.
- ``promote``: a low and a float32 input give torch's float32 result bit for bit; low inputs give a
  low result, compared as ``low`` ops are.
- ``banned``: the emulation refuses the op, naming it.

The references run under a pass-through TorchDispatchMode, as the emulated ops do: under any
dispatch mode torch's linear-algebra composites take another path (``_may_require_fw_or_bw_grad``
is true, so ``linalg_svdvals``, ``linalg_eigvalsh``, ``linalg_cond`` and ``nuclear_norm`` compute
the singular or eigen vectors too, and LAPACK's values differ in the last float32 bit from the
values-only path).  ``RUN_TO_RUN``: ops whose float32 result torch itself does not repeat.
The fp16 tables run by default (about 1.5 s of CPU beside probing the tables, which the other
emulate tests do too); FPEMU_TEST_ENVS=1 adds the bf16 tables (.ci/run stage 2).
"""

import contextlib
import functools
import warnings

import pytest

torch = pytest.importorskip("torch")

import fpemu  # noqa: E402
from fpemu.emulate import op_table  # noqa: E402
from fpemu.emulate._autocast_table import resolve  # noqa: E402
from fpemu.emulate._op_samples import CPU_LESS, arguments, samples  # noqa: E402
from fpemu.emulate._torch_kernels import CPU_LOW_KERNELS  # noqa: E402
from fpemu.errors import FpemuInputError  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

POLICIES = ["cpu_autocast_fp16", "cuda_autocast_fp16", "cpu_autocast_bf16", "cuda_autocast_bf16"]
BF16_IN_STAGE2 = pytest.mark.stage2("the fp16 tables' cases of the same ops")
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
EPSILON = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}

_ACCUMULATES = "the CPU kernel accumulates in another order or in blocks"
# Ops whose torch CPU low-precision kernel does not compute in float32 and round once (measured).
MEASURED = {
    "aten::bmm": _ACCUMULATES, "aten::baddbmm": _ACCUMULATES, "aten::conv1d": _ACCUMULATES,
    "aten::conv1d.padding": _ACCUMULATES, "aten::convolution": _ACCUMULATES, "aten::_convolution": _ACCUMULATES,
    "aten::_convolution.deprecated": _ACCUMULATES,
    "aten::conv_transpose1d": _ACCUMULATES, "aten::conv_transpose2d.input": _ACCUMULATES,
    "aten::conv_transpose3d.input": _ACCUMULATES,
    "aten::conv_tbc": "the CPU kernel adds one low-precision matrix product per kernel tap, each rounded",
    "aten::addbmm": "the CPU kernel rounds intermediate results (measured; not traced to its source)",
    "aten::addr": "the CPU kernel rounds the outer product before adding it (measured)",
    "aten::cross": "the CPU kernel rounds both products before subtracting them (measured)",
    "aten::grid_sampler": "the CPU kernel computes its interpolation weights in the low format (measured)",
    "aten::bilinear": "a composite of matrix products, which accumulate otherwise on the CPU",
    "aten::scaled_dot_product_attention": "a composite of matrix products and a softmax, each rounded",
    "aten::_native_multi_head_attention": "a composite of matrix products and a softmax, each rounded",
    "aten::mkldnn_rnn_layer": "oneDNN's bf16 LSTM (run where oneDNN computes bf16: AVX512, AVX2-VNNI-2; torch has "
                              "no bf16 CPU kernel elsewhere) rounds intermediate results (measured on AVX512_BF16)",
}


# Ops whose torch CPU float32 result itself changes from run to run (measured): compared normwise.
RUN_TO_RUN = {"aten::linalg_lstsq": "MKL's least-squares driver (gelsy) differs in the last bits between calls"}


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _tensors(value) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _mixed(args, low):
    """The arguments with the first floating tensor in the low dtype, the others float32."""
    seen = []

    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not seen:
            seen.append(value)
            return value.to(low)
        return value
    return tuple(torch.utils._pytree.tree_map(cast, list(args)))


def _call(op, args, mode):
    """(result, None) or (None, the exception)."""
    try:
        with mode:
            return op(*args), None
    except Exception as error:  # noqa: BLE001 - a kernel torch lacks, or a refusal: what is compared
        return None, error


@functools.lru_cache(maxsize=None)
def _results(policy: str) -> dict:
    """Every op of the policy's table: (category, emulated results, reference results), computed
    in one emulation (entering one costs about 13 ms for the CUDA table).  Emulated: ``main`` (float32
    inputs for the low and banned ops, low inputs otherwise) and ``mixed`` (promoting ops)."""
    low = LOW[policy.rsplit("_", 1)[1]]
    ops, table = op_table(policy)["ops"], samples()
    cases = {name: (category, *arguments(table[name], low)) for name, category in ops.items() if name not in CPU_LESS}
    references = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated ops (torch.lu, chain_matmul, ...) say so
        for name, (category, wide, narrow) in cases.items():
            op = resolve(name)
            references[name] = {"wide": _call(op, wide, _PassThrough()), "low": _call(op, narrow, _PassThrough())}
        emulated = {}
        with fpemu.emulate_torch(policy):
            for name, (category, wide, narrow) in cases.items():
                op = resolve(name)
                emulated[name] = {"main": _call(op, wide if category in ("low", "banned") else narrow,
                                                contextlib.nullcontext())}
                if category == "promote":
                    emulated[name]["mixed"] = _call(op, _mixed(wide, low), contextlib.nullcontext())
    return {name: (category, emulated[name], references[name]) for name, (category, *_) in cases.items()}


def _bits(tensor):
    tensor = torch.view_as_real(tensor.resolve_conj()) if tensor.is_complex() else tensor
    if not tensor.is_floating_point():
        return tensor
    wide = tensor.float()
    return torch.where(torch.isnan(wide), torch.full_like(wide, float("nan")), wide).view(torch.int32)


def _assert_equal(got, expected, name: str) -> None:
    assert [t.dtype for t in got] == [t.dtype for t in expected], name
    for index, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(_bits(a), _bits(b)), f"{name} result {index}"


def _assert_near(got, expected, name: str, epsilon: float) -> None:
    """Normwise within two epsilons (of the format), NaN where the reference has NaN."""
    for index, (a, b) in enumerate(zip(got, expected)):
        if not b.is_floating_point():
            continue
        a, b = a.float(), b.float()
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name} result {index}"
        finite = ~torch.isnan(b)
        scale = float(b[finite].abs().max()) if finite.any() else 0.0
        distance = float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0
        assert distance <= 2 * epsilon * scale, f"{name} result {index}: {distance} / {scale}"


def _cases():
    for policy in POLICIES:
        for name in sorted(op_table(policy)["ops"]):
            yield pytest.param(policy, name, id=f"{policy}-{name}", marks=BF16_IN_STAGE2 if "bf16" in policy else ())


def test_the_samples_cover_every_op_both_tables_place():
    placed = {name for policy in ("cpu_autocast_fp16", "cuda_autocast_fp16") for name in op_table(policy)["ops"]}
    assert placed == set(samples()) | set(CPU_LESS)
    assert not set(samples()) & set(CPU_LESS) and set(MEASURED) | set(RUN_TO_RUN) <= set(samples())


@pytest.mark.parametrize("policy, name", _cases())
def test_emulated_op_against_torch_cpu(policy, name):
    if name in CPU_LESS:
        pytest.skip(f"{name}: {CPU_LESS[name]}")
    category, emulated, reference = _results(policy)[name]
    low_name = policy.rsplit("_", 1)[1]
    low = LOW[low_name]
    got, error = emulated["main"]
    if category == "banned":
        assert isinstance(error, FpemuInputError) and f"cannot place {name}" in str(error)
        return
    if policy.startswith("cpu_") and name in CPU_LOW_KERNELS and reference["low"][1] is not None:
        # torch's own low kernel runs, and fails as the real call does (oneDNN's float16 LSTM here)
        assert type(error) is type(reference["low"][1]) and str(error) == str(reference["low"][1]), name
        return
    assert error is None, f"{name}: {error!r}"
    if category == "fp32":
        expected, failure = reference["wide"]
        assert failure is None and all(t.dtype == torch.float32 for t in _tensors(got) if t.is_floating_point())
        if name in RUN_TO_RUN:
            _assert_near(_tensors(got), _tensors(expected), name, 2.0 ** -20)
        else:
            _assert_equal(_tensors(got), _tensors(expected), name)
        return
    if category == "promote":
        mixed, failure = emulated["mixed"]
        expected, _ = reference["wide"]
        assert failure is None, f"{name}: {failure!r}"
        _assert_equal(_tensors(mixed), _tensors(expected), f"{name} (a low and a float32 input)")
    assert all(t.dtype == low for t in _tensors(got) if t.is_floating_point()), name
    expected, failure = reference["low"]
    if failure is not None:  # torch has no CPU kernel in the low format: the placement is what is checked
        assert isinstance(failure, RuntimeError), failure
        return
    if name in MEASURED:
        _assert_near(_tensors(got), _tensors(expected), name, EPSILON[low_name])
    else:
        _assert_equal(_tensors(got), _tensors(expected), name)


def test_list_results_of_different_lengths_keep_their_own_dtypes():
    """A GRU cell's gates split in 3 and an LSTM cell's in 4 along rows of the same size: the result
    dtypes are cached per shape, so the LSTM's fourth chunk is rounded too (it stayed float32)."""
    table = samples()
    with fpemu.emulate_torch("cuda_autocast_fp16"):
        for name in ("aten::gru_cell", "aten::lstm_cell"):
            wide, _ = arguments(table[name], torch.float16)
            assert {t.dtype for t in _tensors(resolve(name)(*wide))} == {torch.float16}, name
