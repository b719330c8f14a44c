"""fpemu.emulate_torch against the installed torch: its autocast table, its rounding, its CPU fp16
results and a transformer trained under real CPU autocast with a real GradScaler.

FPEMU_TEST_EXHAUSTIVE=1 also checks torch's float32 -> float16 / bfloat16 casts against fpemu's
kernel on all 2**32 float32 inputs (about 2 minutes a format on one core, with progress lines).
"""

import copy
import json
import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fpemu  # noqa: E402
from fpemu.host import cpu_flags  # noqa: E402
from fpemu.emulate import Telemetry, get_policy, op_table  # noqa: E402
from fpemu.emulate._torch_loop import EmulatedScaler, run_steps  # noqa: E402
from fpemu.emulate._torch_rounding import round_tensor  # noqa: E402
from fpemu.errors import FpemuInputError  # noqa: E402
from fpemu.formats import FORMATS  # noqa: E402

from trace_checks import bits32  # noqa: E402


pytestmark = pytest.mark.usefixtures("torch_one_thread")


D, V, T, B = 16, 32, 8, 4


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def forward(self, x):
        q, k, v = self.qkv(x).split(D, -1)
        causal = torch.triu(torch.full((T, T), -1e4), 1)
        return self.proj(torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5 + causal, -1) @ v)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = torch.nn.LayerNorm(D), _Attention(), torch.nn.LayerNorm(D)
        self.fc, self.out = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class TinyTransformer(torch.nn.Module):
    """Embedding, two pre-LN blocks (causal attention, GELU MLP), a head: a GPT-2 in miniature."""

    def __init__(self):
        super().__init__()
        self.emb, self.blocks = torch.nn.Embedding(V, D), torch.nn.Sequential(_Block(), _Block())
        self.ln, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, V)

    def forward(self, ids):
        return self.head(self.ln(self.blocks(self.emb(ids))))


def _batch(index):
    return torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(index))


def _loss(model, index):
    ids = _batch(index)
    return torch.nn.functional.cross_entropy(model(ids[:, :-1]).float().reshape(-1, V), ids[:, 1:].reshape(-1))


def _step(model, optimizer, scaler, index):
    optimizer.zero_grad()
    loss = _loss(model, index)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


# -- the op tables ----------------------------------------------------------------------------------

def test_cuda_table_is_read_from_torchs_autocast_registrations():
    table = op_table("cuda_autocast_fp16")
    ops = table["ops"]
    assert table["torch"] == torch.__version__ and table["key"] == "AutocastCUDA"
    # torch's documented CUDA lists (docs/amp.rst "CUDA Ops that can autocast to float16/float32")
    assert {ops[op] for op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
                               "aten::baddbmm", "aten::conv1d", "aten::_convolution")} == {"low"}
    assert {ops[op] for op in ("aten::softmax.int", "aten::log_softmax.int", "aten::layer_norm", "aten::sum",
                               "aten::exp", "aten::pow.Tensor_Scalar", "aten::nll_loss", "aten::mse_loss",
                               "aten::cumsum", "aten::rsqrt")} == {"fp32"}
    assert {ops[op] for op in ("aten::addcmul", "aten::addcdiv", "aten::atan2", "aten::index_put",
                               "aten::scatter_add")} == {"promote"}
    assert ops["aten::binary_cross_entropy"] == "banned"


def test_cpu_table_differs_from_cuda_where_torch_registers_differently():
    cpu = op_table("cpu_autocast_fp16")["ops"]
    cuda = op_table("cuda_autocast_fp16")["ops"]
    assert cpu["aten::mm"] == "low" and cpu["aten::cross_entropy_loss" if "aten::cross_entropy_loss" in cpu
                                               else "aten::nll_loss"] == "fp32"
    assert "aten::softmax.int" in cuda and "aten::softmax.int" not in cpu  # CPU autocast leaves softmax alone
    assert cuda["aten::binary_cross_entropy"] == "banned" != cpu["aten::binary_cross_entropy"]
    assert op_table("pure_fp16") == {}


def test_composite_ops_are_classified_without_passing_their_shape_checks():
    """conv2d, cross_entropy_loss, lstm_cell, ... check shapes in C++ before they dispatch: the probe
    stops them below autocast, before any such check, so every registered op is classified."""
    cpu, cuda = op_table("cpu_autocast_bf16"), op_table("cuda_autocast_fp16")
    assert cpu["unclassified"] == [] == cuda["unclassified"]
    assert {cpu["ops"][op] for op in ("aten::conv2d", "aten::conv3d", "aten::conv_transpose2d.input", "aten::prelu")} \
        == {cuda["ops"][op] for op in ("aten::conv2d", "aten::einsum", "aten::lstm_cell", "aten::gru_cell")} == {"low"}
    assert {cpu["ops"][op] for op in ("aten::cross_entropy_loss", "aten::fft_rfft", "aten::quantile", "aten::stft")} \
        == {cuda["ops"][op] for op in ("aten::group_norm", "aten::rms_norm", "aten::cosine_embedding_loss")} == {"fp32"}
    assert {cuda["ops"][op] for op in ("aten::bilinear", "aten::cross", "aten::index_put")} == {"promote"}


def test_an_op_whose_cast_policy_cannot_be_read_is_refused_naming_it():
    """None is unclassified on torch 2.13; one that a later torch leaves unread gets this kernel."""
    from fpemu.emulate._torch_mode import _cast_kernel
    kernel = _cast_kernel(torch.ops.aten.mm.default, "aten::mm", "unclassified", torch.float16,
                          "cuda_autocast_fp16", {})
    with pytest.raises(FpemuInputError, match="cuda_autocast_fp16 cannot place aten::mm: the cast policy"):
        kernel(torch.ones(2, 2), torch.ones(2, 2))


def test_cpu_table_agrees_with_real_cpu_autocast_on_real_shapes():
    """The probe's reading of AutocastCPU against torch's own CPU autocast running the ops."""
    ops = op_table("cpu_autocast_bf16")["ops"]
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    logits, target = torch.randn(4, 5).bfloat16(), torch.tensor([0, 1, 2, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtypes = {"aten::conv2d": torch.nn.functional.conv2d(x, w).dtype,
                  "aten::prelu": torch.nn.functional.prelu(x, torch.ones(1)).dtype,
                  "aten::cross_entropy_loss": torch.nn.functional.cross_entropy(logits, target).dtype,
                  "aten::fft_rfft": torch.fft.rfft(x.bfloat16()).real.dtype}
    assert {op: ops[op] for op in dtypes} == {op: "low" if dtype == torch.bfloat16 else "fp32"
                                              for op, dtype in dtypes.items()}


def test_policies_refuse_bad_fields():
    with pytest.raises(FpemuInputError, match="unknown policy 'cuda_fp16'"):
        get_policy("cuda_fp16")
    with pytest.raises(FpemuInputError, match="no field roundng"):
        get_policy("pure_bf16", roundng="up")
    with pytest.raises(FpemuInputError, match="autocast placement computes in fp16 or bf16"):
        get_policy("cuda_autocast_fp16", compute="fp8_e4m3fn")
    with pytest.raises(FpemuInputError, match="rounding must be one of"):
        get_policy("pure_fp16", rounding="banker")
    assert get_policy("pure_fp16", compute="e5m2").compute.name == "fp8_e5m2"


# -- rounding: torch's casts are fpemu's kernel --------------------------------------------------

def _boundary_values(fmt) -> np.ndarray:
    """Every float32 within 2 ulp of a midpoint between neighbours of fmt's, around its subnormals,
    min normal, max finite and overflow threshold, plus random values over the whole float32 range."""
    values = fpemu.decode(np.arange(0, 1 << fmt.bits, dtype=np.uint32), fmt).astype(np.float64)
    values = values[np.isfinite(values)]
    values.sort()
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    near = (mids.view(np.uint32)[:, None].astype(np.int64) + np.arange(-2, 3)).astype(np.uint32).ravel()
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, 65519.996, 65520.0, 448.0, 464.0,
                         480.0, 57344.0, 61440.0], np.float32).view(np.uint32)
    return np.concatenate([near, random, specials]).view(np.float32)


@pytest.mark.parametrize("name, overflow, carried", [
    ("fp16", "inf", torch.float16), ("bf16", "inf", torch.bfloat16), ("fp16", "inf", torch.float32),
    ("fp8_e4m3fn", "saturate", torch.float32), ("fp8_e5m2", "inf", torch.float32),
    ("fp8_e4m3fnuz", "inf", torch.float32), ("fp8_e5m2fnuz", "inf", torch.float32)])
def test_torch_casts_round_as_fpemus_kernel(name, overflow, carried):
    """Every NATIVE_CASTS entry (torch's float8_e4m3fn cast saturates: it equals overflow='saturate')."""
    fmt = FORMATS[name]
    values = _boundary_values(fmt)
    ours = fpemu.formats.round_to_format(values, fmt, overflow=overflow).values
    theirs = round_tensor(torch.from_numpy(values), fmt, carried, overflow=overflow).float().numpy()
    nan = np.isnan(ours)
    assert np.array_equal(nan, np.isnan(theirs))
    assert bits32(ours[~nan]) == bits32(theirs[~nan])


EXHAUSTIVE_CHUNK = 1 << 24  # float32 bit patterns per chunk: 64 MiB an array, 256 chunks a format


@pytest.mark.skipif(os.environ.get("FPEMU_TEST_EXHAUSTIVE") != "1", reason="all 2**32 inputs: FPEMU_TEST_EXHAUSTIVE=1")
@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_torch_casts_round_as_fpemus_kernel_on_every_float32(name, dtype, capsys):
    """About 0.4 s a chunk, 2 minutes a format on one core (measured on the shared 2-core machine);
    a progress line every 32 chunks (shown through pytest's capture)."""
    fmt = FORMATS[name]
    began = time.perf_counter()
    for index, start in enumerate(range(0, 1 << 32, EXHAUSTIVE_CHUNK), 1):
        values = np.arange(start, start + EXHAUSTIVE_CHUNK, dtype=np.uint32).view(np.float32)
        ours = fpemu.formats.round_to_format(values, fmt).values
        theirs = torch.from_numpy(values).to(dtype).float().numpy()
        differ = (ours.view(np.uint32) != theirs.view(np.uint32)) & ~(np.isnan(ours) & np.isnan(theirs))
        assert not differ.any(), (name, [hex(v) for v in values[differ][:5].view(np.uint32)])
        if index % 32 == 0:
            elapsed = time.perf_counter() - began
            with capsys.disabled():
                print(f"\n{name}: {index}/{(1 << 32) // EXHAUSTIVE_CHUNK} chunks, {elapsed:.0f} s", flush=True)


def test_other_modes_round_through_fpemus_kernel():
    values = torch.tensor([1 + 2 ** -11 + 2 ** -12, -(1 + 2 ** -11 + 2 ** -12), 3e-8, 7e4])
    down = round_tensor(values, FORMATS["fp16"], torch.float16, rounding="toward_zero", subnormals=False)
    assert down.tolist() == [1.0, -1.0, 0.0, 65504.0]
    e5m2 = round_tensor(values, FORMATS["fp8_e5m2"], torch.float32, overflow="saturate")
    assert e5m2.tolist() == fpemu.quantize(values.numpy(), "fp8_e5m2", overflow="saturate").tolist()


# -- ops: the emulation against torch CPU's own fp16 / bf16 kernels -------------------------------

# Ops whose CPU float16 / bfloat16 kernels compute in float32 and round once: the emulated op equals
# them bit for bit (gelu and gelu_backward, whose kernel torch picks by dtype, are tested below).
# The others are measured, not tested for equality, by benchmarks/emulate_ops.py
# (reports/emulate_ops.md): matmuls and reductions (another accumulation order).
EXACT_OPS = {
    "add": lambda a, b: a + b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b, "sub": lambda a, b: a - b,
    "gelu_tanh": lambda a, b: torch.nn.functional.gelu(a, approximate="tanh"),
    "silu": lambda a, b: torch.nn.functional.silu(a), "relu": lambda a, b: torch.relu(a),
    "tanh": lambda a, b: torch.tanh(a),
    "sigmoid": lambda a, b: torch.sigmoid(a), "exp": lambda a, b: torch.exp(a), "neg": lambda a, b: -a,
    "addcmul": lambda a, b: torch.addcmul(a, a, b, value=0.5), "where": lambda a, b: torch.where(a > 0, a, b),
    "threshold_backward": lambda a, b: torch.ops.aten.threshold_backward(a, b, 0.0),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(EXACT_OPS))
def test_elementwise_ops_equal_torchs_low_precision_kernels(name, dtype):
    generator = torch.Generator().manual_seed(1)
    a = (torch.randn(4096, generator=generator) * 4).to(dtype)
    b = (torch.randn(4096, generator=generator) * 4).to(dtype)
    op = EXACT_OPS[name]
    expected = op(a, b)
    wide_a, wide_b = a.float(), b.float()
    with fpemu.emulate_torch("pure_fp16" if dtype == torch.float16 else "pure_bf16"):
        got = op(wide_a, wide_b)
    nan = torch.isnan(expected)
    assert torch.equal(nan, torch.isnan(got))
    assert torch.equal(expected[~nan].float().view(torch.int32), got[~nan].view(torch.int32)), name


# -- gelu: torch picks its CPU kernel by dtype and kernel tier (fpemu/emulate/_torch_kernels.py) --

# The one input where the emulation differs from torch's float16 gelu_backward, on ATen's AVX2 and
# AVX512 tiers only: there torch's float32 kernel computes one float32 ulp above the midpoint of two
# float16 values and its float16 kernel the midpoint itself (measured: the two are compiled
# separately; on the DEFAULT tier both give the midpoint).  (x, dy, torch's float16, the emulation's)
VECTORIZED_GELU_BACKWARD = (1.80859375, 0.89697265625, 0.9912109375, 0.99169921875)


def _expected_gelu_mismatches(capability: str) -> dict:
    vectorized = capability in ("AVX2", "AVX512")
    return {"gelu float16": [], "gelu bfloat16": [], "gelu_backward bfloat16": [],
            "gelu_backward float16": [list(VECTORIZED_GELU_BACKWARD[:2])] if vectorized else []}


def _differing(got, expected):
    got, expected = got.float(), expected.float()
    return (got.view(torch.int32) != expected.view(torch.int32)) & ~(torch.isnan(got) & torch.isnan(expected))


def gelu_mismatches() -> dict:
    """{"gelu float16": [[x, dy], ...], ...}: where gelu and gelu_backward emulated under pure_fp16 /
    pure_bf16 differ from torch's own float16 / bfloat16 CPU kernels in any bit (NaN-aware), for x
    every value of the dtype and dy seeded normal values, then those scaled by 2**-118 (results
    subnormal in float32: oneDNN's bf16 store flushes them)."""
    mismatches = {}
    for dtype, policy in ((torch.float16, "pure_fp16"), (torch.bfloat16, "pure_bf16")):
        name = str(dtype).removeprefix("torch.")
        x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        normal = torch.randn(x.numel(), generator=torch.Generator().manual_seed(2))
        dys = [normal.to(dtype), (normal * 2.0 ** -118).to(dtype)]
        wide_x, wide_dys = x.float(), [dy.float() for dy in dys]
        with fpemu.emulate_torch(policy):
            forward = torch.nn.functional.gelu(wide_x)
            backwards = [torch.ops.aten.gelu_backward(dy, wide_x) for dy in wide_dys]
        mismatches[f"gelu {name}"] = _inputs_where(_differing(forward, torch.nn.functional.gelu(x)), x)
        mismatches[f"gelu_backward {name}"] = [
            inputs for dy, got in zip(dys, backwards)
            for inputs in _inputs_where(_differing(got, torch.ops.aten.gelu_backward(dy, x)), x, dy)]
    return mismatches


def _inputs_where(differ, *tensors) -> list:
    """[[x, dy, ...], ...]: the tensors' values (as floats) where ``differ`` is set."""
    return [list(values) for values in zip(*(t[differ].float().tolist() for t in tensors))]


def gelu_tier_report() -> dict:
    """What the tier subprocess prints: the running torch's kernel tiers and the gelu mismatches."""
    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(), "mismatches": gelu_mismatches()}


def test_gelu_equals_torchs_low_precision_kernels_on_every_input():
    """On this process's tiers (on an AVX512_BF16 host bf16 gelu runs oneDNN, float16 ATen's kernel)."""
    assert gelu_mismatches() == _expected_gelu_mismatches(torch.backends.cpu.get_cpu_capability())


def test_float16_gelu_backward_differs_at_one_float16_midpoint_on_the_vectorized_tiers():
    x, dy, theirs, ours = (torch.full((64,), v, dtype=torch.float16) for v in VECTORIZED_GELU_BACKWARD)
    assert torch.equal(torch.ops.aten.gelu_backward(dy, x), theirs)
    wide_x, wide_dy = x.float(), dy.float()
    with fpemu.emulate_torch("pure_fp16"):
        got = torch.ops.aten.gelu_backward(wide_dy, wide_x)
    vectorized = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    assert torch.equal(got, (ours if vectorized else theirs).float())


# (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) each run in a subprocess: an AVX2 machine's tiers by
# default; FPEMU_TEST_ENVS=1 adds ATen's scalar tier and oneDNN's AVX512 without bf16 instructions
# (its bf16 store then rounds subnormals instead of flushing them).
OTHER_TIER = pytest.mark.stage2("the AVX2 tiers' case of this test")
TIERS = [("avx2", "AVX2"), pytest.param("default", None, marks=OTHER_TIER),
         pytest.param(None, "AVX512_CORE", marks=OTHER_TIER)]


@pytest.mark.parametrize("aten, onednn", TIERS)
def test_gelu_equals_torchs_low_precision_kernels_on_other_kernel_tiers(aten, onednn):
    """The tiers can only be capped below the CPU's (the variables are read when torch starts)."""
    import subprocess
    import sys
    if aten == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("ATen's AVX2 tier needs an AVX2 CPU")
    if (aten, onednn) == ("avx2", "AVX2") and torch.backends.cpu.get_cpu_capability() == "AVX2" \
            and not cpu_flags() & {"avx512f", "avx_vnni", "avx_ne_convert", "amx_tile"}:
        pytest.skip("these are this CPU's own tiers (nothing above AVX2): "
                    "test_gelu_equals_torchs_low_precision_kernels_on_every_input ran them in this process")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    capped = {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}
    env = {key: value for key, value in os.environ.items() if key not in capped}
    env.update({"PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")]), "OMP_NUM_THREADS": "1",
                **{key: value for key, value in capped.items() if value}})
    code = "import json, test_emulate_torch as t; print(json.dumps(t.gelu_tier_report()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    if aten:
        assert report["aten"] == aten.upper()
    if onednn == "AVX2":
        assert not report["onednn_bf16"]  # bf16 gelu then runs ATen's kernel, as float16's does
    assert report["mismatches"] == _expected_gelu_mismatches(report["aten"])


# -- the emulation: placement, errors, telemetry ---------------------------------------------------

def test_autocast_placement_gives_the_real_dtypes_and_lists_float32_ops():
    model = TinyTransformer()
    with fpemu.emulate_torch("cuda_autocast_fp16", model=model) as telemetry:
        logits = model(_batch(0)[:, :-1])
        with torch.no_grad():
            probs = torch.softmax(logits, -1)
    assert logits.dtype == torch.float16 and probs.dtype == torch.float32   # CUDA: softmax in float32
    summary = telemetry.summary()
    assert "aten::native_layer_norm" in summary.float32_ops and "aten::mm" not in summary.float32_ops
    assert ("forward", "blocks.0.fc") in summary.by_module


def test_bias_gradient_overflow_is_found_in_its_module_in_backward():
    """The overflow the issue's prototype missed: each gradient element fits fp16, the bias-gradient sum
    over the batch (an fp16 reduction of float32 accumulation) does not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    torch.nn.init.zeros_(model[0].bias)
    x = torch.randn(4096, 8) * 1e-3   # small activations: the weight gradients stay finite
    with fpemu.emulate_torch("cuda_autocast_fp16", model=model) as telemetry:
        loss = model(x).float().sum()
        (loss * 64.0).backward()
    first = telemetry.summary().first_nonfinite
    assert "forward" not in first
    assert (first["backward"].op, first["backward"].module) == ("aten::sum.dim_IntList", "2")
    assert torch.isinf(model[2].bias.grad).all() and torch.isfinite(model[2].weight.grad).all()


def test_ops_the_policy_cannot_place_are_errors_naming_them():
    probs, target = torch.rand(8), torch.rand(8)
    with pytest.raises(FpemuInputError, match="cannot place aten::binary_cross_entropy"):
        with fpemu.emulate_torch("cuda_autocast_fp16"):
            torch.nn.functional.binary_cross_entropy(probs, target)
    with pytest.raises(FpemuInputError, match=r"cannot place aten::add.Tensor: it received a torch.float64"):
        with fpemu.emulate_torch("pure_bf16"):
            torch.ones(2, dtype=torch.float64) + 1
    assert torch.nn.functional.binary_cross_entropy(probs, target).dtype == torch.float32  # CPU kernels restored
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(torch.ones(2).half(), 0).dtype == torch.float16


def test_autocast_placement_leaves_float64_alone_as_autocast_does():
    """linalg_matrix_rank computes its tolerance in float64 inside: the pure placement refuses float64,
    autocast runs it untouched."""
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with fpemu.emulate_torch("cpu_autocast_fp16"):
        rank = torch.linalg.matrix_rank(a.half())
        doubled = torch.ones(2, dtype=torch.float64) * 2
    assert rank.item() == 4 and doubled.dtype == torch.float64
    with pytest.raises(FpemuInputError, match=r"cpu_autocast_bf16 cannot place aten::add.Tensor: it received a "
                                              r"torch.float16"):
        with fpemu.emulate_torch("cpu_autocast_bf16"):
            torch.ones(2, dtype=torch.float16) + 1   # another low dtype than the policy's: not emulated, refused


def test_low_accumulation_rounds_the_running_sum():
    """512 ones sum to 512 in float32 accumulation; a bf16 running sum stalls at 256 (256 + 1 rounds to 256)."""
    ones_row, ones_column = torch.ones(1, 512), torch.ones(512, 1)
    with fpemu.emulate_torch("pure_bf16"):
        fp32_sum = ones_row @ ones_column
    with fpemu.emulate_torch("pure_bf16", accumulation="low", accumulation_block=1) as telemetry:
        low_sum = ones_row @ ones_column
        low_reduction = ones_row.sum(1)
    assert (fp32_sum.item(), low_sum.item(), low_reduction.item()) == (512.0, 256.0, 256.0)
    assert ("forward", "aten::mm (partial sum)") in telemetry.summary().by_op


def test_low_accumulation_models_sums_means_and_convolutions_forward_and_backward():
    """Each accumulating op the policies place stalls where a bf16 running sum of ones stalls (256)."""
    with fpemu.emulate_torch("pure_bf16", accumulation="low") as telemetry:
        several_dims = torch.ones(2, 256, 2).sum([0, 1])                          # 512 terms each
        mean = torch.ones(1024).mean()                                            # 256 / 1024
        x = torch.ones(1, 512, 2, 2, requires_grad=True)
        conv = torch.nn.Conv2d(512, 512, 1)
        torch.nn.init.ones_(conv.weight)
        torch.nn.init.zeros_(conv.bias)
        out = conv(x)
        out.backward(torch.ones_like(out))
    assert several_dims.tolist() == [256.0, 256.0] and mean.item() == 0.25
    assert out.unique().tolist() == [256.0] and x.grad.unique().tolist() == [256.0]   # 512 channels each way
    assert conv.bias.grad.unique().tolist() == [4.0]                                   # 4 positions: exact
    assert not any("accumulates in float32" in op for op in telemetry.summary().float32_ops)
    batch = torch.ones(512, 1, 1, 1)
    layer = torch.nn.Conv2d(1, 1, 1, bias=False)
    with fpemu.emulate_torch("pure_bf16", accumulation="low"):
        layer(batch).sum().backward()
    assert layer.weight.grad.item() == 256.0                                           # 512 samples


@pytest.mark.parametrize("transposed, groups", [(False, 1), (False, 2), (True, 1), (True, 2)])
def test_low_accumulation_blocks_of_a_convolution_add_up_to_the_convolution(transposed, groups):
    """With exact sums (small integers) and no rounding, the channel and batch blocks give torch's own
    convolution and its gradients (and addbmm's blocks its result) bit for bit: every term once."""
    from fpemu.emulate._torch_accumulation import low_accumulated
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (3, 4, 5, 5), generator=generator).float()
    shape = (4, 6 // groups, 3, 3) if transposed else (6, 4 // groups, 3, 3)
    w = torch.randint(-3, 4, shape, generator=generator).float()
    bias = torch.randint(-3, 4, (6,), generator=generator).float()
    common = ([1, 1], [1, 1], [1, 1], transposed, [0, 0], groups)
    expected = torch.ops.aten.convolution(x, w, bias, *common)
    got = low_accumulated(torch.ops.aten.convolution.default, "aten::convolution", "aten::convolution",
                          (x, w, bias, *common), {}, 1, lambda v: v)
    assert torch.equal(got, expected)
    grad = torch.randint(-3, 4, expected.shape, generator=generator).float()
    if not transposed and groups == 1:  # addbmm's terms: each batch's inner dimension, batch after batch
        bias, batch1, batch2 = x[0, 0], x[:, 1], x[:, 2].transpose(1, 2)
        blocked = low_accumulated(torch.ops.aten.addbmm.default, "aten::addbmm", "aten::addbmm",
                                  (bias, batch1, batch2), {}, 1, lambda v: v)
        assert torch.equal(blocked, torch.addbmm(bias, batch1, batch2))
    backward = (grad, x, w, [6], *common, [True, True, True])
    expected = torch.ops.aten.convolution_backward(*backward)
    got = low_accumulated(torch.ops.aten.convolution_backward.default, "aten::convolution_backward",
                          "aten::convolution_backward", backward, {}, 1, lambda v: v)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_low_accumulation_refuses_the_accumulating_ops_it_does_not_model():
    for name, call in (("aten::_softmax", lambda x: torch.softmax(x, -1)), ("aten::conv_tbc",
                       lambda x: torch.conv_tbc(x[:, :, None], torch.ones(1, 1, 1), torch.zeros(1))),
                       ("aten::_fft_r2c", torch.fft.rfft), ("aten::upsample_bilinear2d",
                       lambda x: torch.nn.functional.interpolate(x[None, None], scale_factor=2, mode="bilinear"))):
        with pytest.raises(FpemuInputError, match=rf"accumulation='low' cannot model {name}: .*accumulation='fp32'"):
            with fpemu.emulate_torch("pure_bf16", accumulation="low"):
                call(torch.ones(4, 4))
    with pytest.raises(FpemuInputError, match=r"_for_cpu: .*attn_implementation='eager'"):
        with fpemu.emulate_torch("cuda_autocast_bf16", accumulation="low"):
            torch.nn.functional.scaled_dot_product_attention(*[torch.ones(1, 2, 4, 8)] * 3)
    with fpemu.emulate_torch("pure_bf16", accumulation="low"):   # pointwise, data movement, selections: run
        kept = torch.cat([torch.ones(2).exp(), torch.ones(2).amax(0, keepdim=True)]).sort().values
    with pytest.raises(FpemuInputError, match=r"cannot model aten::addmm: the model takes no alpha"):
        with fpemu.emulate_torch("pure_bf16", accumulation="low"):
            torch.addmm(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2), alpha=2.0)
    assert kept.tolist() == [1.0, 2.71875, 2.71875]


def test_fp8_quantizes_forward_e4m3_and_gradients_e5m2():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    with fpemu.emulate_torch("fp8", model=layer) as telemetry:
        layer(x).square().sum().backward()
    by_op = telemetry.summary().by_op
    assert by_op[("forward", "aten::mm")][0] == 8 * 16 + 16 * 16          # both operands quantized
    assert ("backward", "aten::mm") in by_op
    expected = (fpemu.quantize(x.detach().numpy() * 2 ** np.floor(np.log2(448 / x.abs().max().item())), "fp8_e4m3fn")
                / 2 ** np.floor(np.log2(448 / x.abs().max().item())))
    w = layer.weight.detach().numpy()
    w_scale = 2 ** np.floor(np.log2(448 / np.abs(w).max()))
    with torch.no_grad(), fpemu.emulate_torch("fp8"):
        y = layer(x)
    w_quantized = fpemu.quantize(w * w_scale, "fp8_e4m3fn") / w_scale
    assert np.array_equal(y.numpy(), (expected @ w_quantized.T).astype(np.float32))


def test_fp8_delayed_scaling_takes_each_operands_scale_from_its_amax_history():
    """Three forward steps of a Linear under fp8_delayed: each operand is cast with the scale
    fpemu's DelayedScaling recipe gives after the earlier steps' amaxes (saturating, as TE's cast kernels)."""
    from fpemu.scalers.fp8_recipes import DelayedScaling
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16, bias=False)
    inputs = [(torch.rand(8, 16) * 2 - 1) * amax for amax in (4.0, 8.0, 1.0)]
    for x, amax in zip(inputs, (4.0, 8.0, 1.0)):
        x[0, 0] = amax                      # the second saturates at the scale from the first, 448 / 4
    with torch.no_grad(), fpemu.emulate_torch("fp8_delayed", model=layer, amax_history_len=2) as telemetry:
        outputs = [layer(x) for x in inputs]
    recipe = DelayedScaling(amax_history_len=2)
    w = layer.weight.detach()

    def cast(value, scale):
        scale = np.float32(scale)
        quantized = fpemu.quantize(value.numpy() * scale, "fp8_e4m3fn", overflow="saturate")
        return torch.from_numpy(quantized * (np.float32(1) / scale))
    x_scales = [1.0] + list(recipe.run([float(x.abs().max()) for x in inputs]).scale)
    w_scales = [1.0] + list(recipe.run([float(w.abs().max())] * 3).scale)
    for step, (x, y) in enumerate(zip(inputs, outputs)):
        assert torch.equal(y, cast(x, x_scales[step]) @ cast(w.T, w_scales[step])), step
    assert x_scales[1] == 112.0 and telemetry.summary().by_op[("forward", "aten::mm")][0] == 3 * (8 * 16 + 16 * 16)
    with pytest.raises(FpemuInputError, match="fp8_scaling='delayed' applies to placement 'fp8'"):
        get_policy("pure_fp16", fp8_scaling="delayed")
    with pytest.raises(FpemuInputError, match="delayed fp8 scaling: amax_compute_algo"):
        get_policy("fp8_delayed", amax_compute_algo="mean")
    with pytest.raises(FpemuInputError, match="fp8 GEMMs accumulate in float32"):
        get_policy("fp8", accumulation="low")


def test_stochastic_rounding_of_the_update_keeps_weights_in_the_format():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    with fpemu.emulate_torch("pure_bf16", update_rounding="stochastic", seed=3):
        layer(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    weights = layer.weight.detach().numpy()
    assert np.array_equal(weights, fpemu.quantize(weights, "bf16"))


# -- the model: emulated fp16 against real CPU autocast and GradScaler ----------------------------

def test_emulated_fp16_training_overflows_where_real_cpu_autocast_does():
    torch.manual_seed(0)
    params = {"init_scale": 2.0 ** 22, "growth_interval": 2}
    model = TinyTransformer()
    real, emulated = copy.deepcopy(model), copy.deepcopy(model)
    optimizer = torch.optim.SGD(real.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **params)
    real_scales, real_skips = [], []
    for index in range(8):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(real, index)
        real_scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        real_skips.append(scaler.get_scale() < real_scales[-1])
    records, _ = run_steps(_step, emulated, torch.optim.SGD(emulated.parameters(), lr=0.1), steps=8,
                           policy="cpu_autocast_fp16", profile="torch", params=params)
    assert [r.overflow for r in records] == real_skips and any(real_skips) and not all(real_skips)
    emulated_scales = fpemu.simulate_scaler([r.overflow for r in records], "torch", **params).scales
    assert emulated_scales == real_scales


def test_scaler_refuses_misuse():
    scaler = EmulatedScaler("torch", {"init_scale": 4.0})
    with pytest.raises(FpemuInputError, match="update\\(\\) before step"):
        scaler.update()
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler.scale(layer(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(FpemuInputError, match="already called"):
        scaler.unscale_(optimizer)
    assert isinstance(Telemetry().summary().as_dict(), dict)


@pytest.mark.parametrize("module", ["fpemu.emulate.policy", "fpemu.emulate._torch_rounding",
                                    "fpemu.emulate._torch_accumulation"])
def test_docstring_examples(module):
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_pure_placement_takes_any_format_rounding_and_subnormal_policy():
    x = torch.tensor([1.0, 3.0, 1e-6, 300.0])
    y = torch.zeros(4)
    with fpemu.emulate_torch("pure_fp16", compute="fp8_e5m2") as telemetry:
        torch.mul(x, 1.1, out=y)                      # an out= op writes its rounded result
        x.mul_(1.1)                                   # an in-place op too
    expected = fpemu.quantize(fpemu.quantize(np.array([1.0, 3.0, 1e-6, 300.0], np.float32), "fp8_e5m2")
                              * np.float32(1.1), "fp8_e5m2")
    assert bits32(y.numpy()) == bits32(expected) == bits32(x.numpy())
    with fpemu.emulate_torch("pure_fp16", subnormals=False) as flushed:
        tiny = torch.tensor([1e-5, 1e-7]) * 1.0
    assert tiny.tolist() == [0.0, 0.0]
    assert flushed.summary().by_op[("forward", "aten::mul.Tensor (input)")][1] == 2   # both fp16 subnormals: flushed
    inputs = {op: counts for (_, op), counts in telemetry.summary().by_op.items() if op.endswith("(input)")}
    assert inputs["aten::mul.out (input)"][1] == 1   # x's 1e-6 is below e5m2's smallest subnormal


def test_stochastic_rounding_is_seeded():
    x = torch.full((10000,), 1.0 + 2 ** -10)
    runs = []
    for seed in (1, 1, 2):
        with fpemu.emulate_torch("pure_bf16", rounding="stochastic", seed=seed):
            runs.append(x * 1.0)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert set(runs[0].tolist()) == {1.0, 1.0078125} and 0.05 < (runs[0] > 1).float().mean() < 0.2
