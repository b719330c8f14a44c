"""emulate_torch on model families fpemu's other tests never saw, against real CPU autocast + GradScaler.

Checked with torch 2.13.0+cpu and transformers 5.24 on an AMD EPYC with AVX512_BF16.  By default:
a ResNet-18 (torchvision's, written out in model_families.py) trained under cpu_autocast_bf16 and
_fp16 equals the real run bit for bit (losses, overflow verdicts, scales, step-0 gradients, weights
and batch-norm running statistics after the steps); every op of ``CPU_LOW_KERNELS`` departs from
float32 rounded once on a sample and is emulated as torch's kernel computes it; the emulated scaler
reports the scale as GradScaler does.  FPEMU_TEST_EXAMPLES=1 (.ci/run stage 2) adds the transformers
families (Llama, GPT-2 with scaled_dot_product_attention, BERT, T5, ViT) and an LSTM.
"""

import copy
import os

import pytest

torch = pytest.importorskip("torch")

import fpemu  # noqa: E402
from fpemu.emulate import op_table  # noqa: E402
from fpemu.emulate._torch_kernels import CPU_LOW_KERNELS, NO_FLOAT32_CALL  # noqa: E402
from fpemu.emulate._torch_loop import EmulatedScaler, run_steps  # noqa: E402
from fpemu.errors import FpemuInputError  # noqa: E402

import model_families  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _bits(tensor):
    """float32 bit patterns, every NaN one pattern."""
    wide = tensor.detach().float()
    return torch.where(torch.isnan(wide), torch.full_like(wide, float("nan")), wide).view(torch.int32)


def _gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _real_run(model, loss_of, fmt, steps, params):
    """(losses, overflow verdicts read off found_inf, scales, step-0 gradients) of real CPU autocast."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", **params)
    losses, verdicts, scales, first = [], [], [], None
    torch.manual_seed(1)  # dropout draws: both runs start from the same generator state
    for index in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=LOW[fmt]):
            loss = loss_of(model, index)
        scaler.scale(loss).backward()
        first = first or _gradients(model)
        scaler.unscale_(optimizer)
        verdicts.append(bool(sum(float(v) for v in scaler._found_inf_per_device(optimizer).values())))
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses, verdicts, scales, first


def _emulated_run(model, loss_of, fmt, steps, params):
    captured = {}

    def step(model, optimizer, scaler, index):
        optimizer.zero_grad()
        loss = loss_of(model, index)
        scaler.scale(loss).backward()
        captured.setdefault("first", _gradients(model))
        captured.setdefault("scales", []).append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        return loss
    torch.manual_seed(1)
    records, _ = run_steps(step, model, torch.optim.SGD(model.parameters(), lr=0.01), steps=steps,
                           policy=f"cpu_autocast_{fmt}", params=params)
    return [r.loss for r in records], [r.overflow for r in records], captured["scales"], captured["first"]


def _both(family, fmt, steps, params):
    torch.manual_seed(0)
    model, loss_of = model_families.FAMILIES[family]()
    real_model, emulated_model = copy.deepcopy(model), copy.deepcopy(model)
    real = _real_run(real_model, loss_of, fmt, steps, params)
    emulated = _emulated_run(emulated_model, loss_of, fmt, steps, params)
    return real, emulated, real_model, emulated_model


# 2 x 3 x 32 x 32 images: at 16 x 16, layer4's first convolution sees 1 x 1 inputs and torch's real bf16
# weight gradient there is sporadically non-finite (2 of 12 runs, torch 2.13.0+cpu): no reference to test on
# init scales: bf16 never overflows at 2**24 here; fp16 at 2**12 overflows on some steps, not all
RESNET_SCALES = {"bf16": 2.0 ** 24, "fp16": 2.0 ** 12}
RESNET_FORMATS = ["bf16"] + (["fp16"] if os.environ.get("FPEMU_TEST_EXAMPLES") == "1" else [])


@pytest.mark.parametrize("fmt", RESNET_FORMATS)  # fp16 (torch's slow CPU fp16 convolutions) in stage 2
def test_resnet18_trains_as_real_cpu_autocast_bit_for_bit(fmt):
    (losses, verdicts, scales, first), emulated, real_model, emulated_model = _both(
        "resnet18", fmt, 2, {"init_scale": RESNET_SCALES[fmt]})
    assert emulated[1] == verdicts and [s for s in emulated[2]] == scales
    assert [float(v) for v in emulated[0]] == losses
    assert first.keys() == emulated[3].keys()
    for name, gradient in first.items():
        assert torch.equal(_bits(gradient), _bits(emulated[3][name])), name
    for (name, a), (_, b) in zip(real_model.state_dict().items(), emulated_model.state_dict().items()):
        assert torch.equal(_bits(a) if a.is_floating_point() else a, _bits(b) if b.is_floating_point() else b), name


class _Zoo(torch.nn.Module):
    """One call of each op of CPU_LOW_KERNELS (forward and backward) on shapes where it departs."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.gn, self.ln = torch.nn.GroupNorm(4, 16), torch.nn.LayerNorm(64)
        self.rnn = torch.nn.LSTM(16, 16, batch_first=True)

    def forward(self, x):
        x = self.gn(self.bn(self.conv(x)))
        pooled = torch.nn.functional.max_pool2d(x, 3, 2, 1) + torch.nn.functional.avg_pool2d(x, 3, 2, 1)
        adaptive = torch.nn.functional.adaptive_avg_pool2d(x, (3, 3))
        tokens = self.ln(x[..., ::2, ::2].flatten(2).pow(3))  # (4, 16, 64)
        q = tokens.unflatten(-1, (4, 16)).transpose(1, 2)  # (4, 4, 16, 16)
        attended = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out = self.rnn(attended.flatten(1, 2))[0] if x.dtype != torch.float16 else attended
        # weighted sums: a gradient of ones would add exactly in any dtype
        return sum((t.float() * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))).sum()
                   for i, t in enumerate((pooled, adaptive, out, attended)))


class _Calls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op, cloned arguments) of the calls to CPU_LOW_KERNELS ops."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in CPU_LOW_KERNELS:
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            self.calls.append((name, func, torch.utils._pytree.tree_map(clone, (args, kwargs or {}))))
        return func(*args, **(kwargs or {}))


def _recorded_calls(fmt):
    torch.manual_seed(0)
    zoo, calls = _Zoo(), _Calls()
    x = torch.randn(4, 8, 16, 16)
    with calls:
        with torch.autocast("cpu", dtype=LOW[fmt]):
            loss = zoo(x)
        loss.backward()
    return calls.calls


def _floating(out) -> dict:
    """{position among the op's results: result} of its floating results."""
    return {i: t for i, t in enumerate(torch.utils._pytree.tree_leaves(out))
            if isinstance(t, torch.Tensor) and t.is_floating_point()}


def _float32_rounded_once(func, args, kwargs, low, real: dict) -> dict:
    """The op computed in float32 from float32 copies of the low inputs, each result the real run has
    low rounded once to it."""
    up = lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype == low else v  # noqa: E731
    out = _floating(func(*torch.utils._pytree.tree_map(up, args), **torch.utils._pytree.tree_map(up, kwargs)))
    return {i: out[i].to(real[i].dtype) for i in real}


def test_each_cpu_low_kernel_departs_from_float32_rounded_once_and_is_emulated_as_torchs():
    departs, seen = set(), set()
    for fmt in ("bf16", "fp16"):
        low = LOW[fmt]
        for name, func, (args, kwargs) in _recorded_calls(fmt):
            seen.add(name)
            copy_of = lambda: torch.utils._pytree.tree_map(  # noqa: E731
                lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
            real_args, real_kwargs = copy_of()
            real = _floating(func(*real_args, **real_kwargs))
            emulated_args, emulated_kwargs = copy_of()
            with fpemu.emulate_torch(f"cpu_autocast_{fmt}"):
                emulated = _floating(func(*emulated_args, **emulated_kwargs))
            assert real.keys() == emulated.keys() and all(torch.equal(_bits(real[i]), _bits(emulated[i])) for i in real), \
                f"{name} ({fmt})"
            if name in NO_FLOAT32_CALL:  # no float32 call to compare with (it would misread the workspace)
                continue
            once = _float32_rounded_once(func, *copy_of(), low, real)
            if any(not torch.equal(_bits(real[i]), _bits(once[i])) for i in real):
                departs.add(name)
    # oneDNN's LSTM layer runs only where oneDNN computes bf16 (its AVX512_BF16 kernels); without them
    # (ONEDNN_MAX_CPU_ISA=AVX2) torch takes its own LSTM path and the layer ops are never called
    not_here = set() if _onednn_computes_bf16() else {"aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward"}
    assert seen == set(CPU_LOW_KERNELS) - not_here, set(CPU_LOW_KERNELS) - not_here - seen
    # oneDNN's AVX512_CORE_FP16 and AMX convolutions (Sapphire Rapids) round these samples once; its
    # AVX512_BF16 ones and below do not.  The emulation runs torch's own kernel on every tier alike.
    rounds_once = {"aten::convolution", "aten::convolution_backward"} if _onednn_runs_fp16_isa() else set()
    expected = set(CPU_LOW_KERNELS) - NO_FLOAT32_CALL - not_here - rounds_once
    assert departs == expected, sorted(expected ^ departs)


def test_cpu_fp16_lstm_fails_as_real_cpu_autocast_does():
    """oneDNN has no float16 LSTM here: the real run raises, and so does the emulation (torch's error)."""
    model = torch.nn.LSTM(8, 8)
    with pytest.raises(RuntimeError) as real, torch.autocast("cpu", dtype=torch.float16):
        model(torch.randn(3, 1, 8))
    with pytest.raises(RuntimeError) as emulated, fpemu.emulate_torch("cpu_autocast_fp16"):
        model(torch.randn(3, 1, 8))
    assert str(emulated.value) == str(real.value)


def test_cuda_table_runs_cudnn_rnns_in_float16_as_cuda_builds_register():
    """The rule comes from torch's source (a CPU build registers no cuDNN autocast kernel): the op table a
    trace records names it apart from what the dispatcher showed, and where it came from."""
    table = op_table("cuda_autocast_fp16")
    assert table["read_on"] == ("CPU" if torch.version.cuda is None else f"CUDA {torch.version.cuda}")
    assert table["from_source"]["ops"]["aten::lstm.input"] == "float16" and "aten::lstm.input" not in table["ops"]
    assert "AutocastRNN.cpp" in table["from_source"]["where"] and "from_source" not in op_table("cpu_autocast_fp16")
    model = torch.nn.LSTM(8, 8)
    with fpemu.emulate_torch("cuda_autocast_fp16") as telemetry:
        out, _ = model(torch.randn(3, 1, 8))
    summary = telemetry.summary()
    assert out.dtype == torch.float16 and not [op for op in summary.float32_ops if "rnn" in op or "lstm" in op]
    assert ("forward", "aten::addmm") in summary.by_op  # the gates' matrix products, emulated in float16
    with pytest.raises(FpemuInputError, match="cannot place aten::lstm.input: CUDA autocast runs cuDNN's RNNs in float16"):
        with fpemu.emulate_torch("cuda_autocast_bf16"):
            model(torch.randn(3, 1, 8))


def test_emulated_scaler_reports_the_scale_as_grad_scaler_does():
    """GradScaler.get_scale() is init_scale as given until scale() makes its float32 tensor."""
    real, emulated = torch.amp.GradScaler("cpu", init_scale=3.3e35), EmulatedScaler("torch", {"init_scale": 3.3e35})
    before = real.get_scale(), emulated.get_scale()
    real.scale(torch.ones(())), emulated.scale(torch.ones(()))
    assert before == (3.3e35, 3.3e35) and real.get_scale() == emulated.get_scale() == float(torch.tensor(3.3e35))


# -- stage 2: the transformers families ------------------------------------------------------------

EXAMPLES = pytest.mark.skipif(os.environ.get("FPEMU_TEST_EXAMPLES") != "1",
                              reason="transformers models (seconds each): set FPEMU_TEST_EXAMPLES=1")
# the least share of step-0 gradient elements equal bit for bit (measured: bf16 0.999-1.0 where oneDNN computes
# bf16; fp16, whose matrix products ATen accumulates in another order than the float32 kernel, 0.22-0.85)
BITWISE = {"bf16": 0.99, "fp16": 0.2}
# Where oneDNN does not compute bf16 (an AVX2 CPU: no avx512_bf16; measured on an AMD EPYC with avx2, fma, f16c,
# torch 2.13.0): the trajectories still agree (overflow verdicts and scales), step-0 gradients agree bit for bit
# on 98.1-98.2% of elements for GPT-2 with SDPA and BERT but 18.2% for T5 (as low as fp16's: torch's bf16 matrix
# products there accumulate otherwise than the float32 kernel, as its fp16 ones do everywhere), and T5's loss
# departs 4.5e-4 relative; which kernel it is, is not pinned down yet.  The bounds below are under those figures.
BITWISE_WITHOUT_ONEDNN_BF16, LOSS_WITHOUT_ONEDNN_BF16 = 0.15, 1e-3


def _onednn_computes_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@EXAMPLES
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama", "gpt2_sdpa", "bert", "t5", "vit", "lstm"])
def test_model_family_trains_as_real_cpu_autocast(family, fmt):
    pytest.importorskip("transformers")
    if family == "lstm" and fmt == "fp16":
        pytest.skip("oneDNN has no float16 LSTM: test_cpu_fp16_lstm_fails_as_real_cpu_autocast_does")
    onednn_bf16 = _onednn_computes_bf16()
    if family == "lstm" and not onednn_bf16:
        # measured on an AVX2 host: real CPU autocast raises "could not create a primitive descriptor for the LSTM
        # forward propagation primitive" in bf16 too
        pytest.skip("oneDNN has no bf16 LSTM on a CPU without avx512_bf16: real CPU autocast raises")
    (losses, verdicts, scales, first), emulated, _, _ = _both(family, fmt, 4, {"init_scale": 2.0 ** 16})
    assert emulated[1] == verdicts and emulated[2] == scales
    loss_bound, bitwise = ((1e-4, BITWISE[fmt]) if fmt != "bf16" or onednn_bf16 else
                           (LOSS_WITHOUT_ONEDNN_BF16, BITWISE_WITHOUT_ONEDNN_BF16))
    assert max(abs(a - b) / abs(a) for a, b in zip(losses, emulated[0])) <= loss_bound
    equal = sum(int((_bits(g) == _bits(emulated[3][n])).sum()) for n, g in first.items())
    assert equal / sum(g.numel() for g in first.values()) >= bitwise


@EXAMPLES
def test_llama_bf16_step0_verdict_at_init_scale_3_3e35():
    pytest.importorskip("transformers")
    (losses, verdicts, scales, first), emulated, _, _ = _both("llama", "bf16", 1, {"init_scale": 3.3e35})
    assert emulated[1] == verdicts == [False] and emulated[2] == scales


# The normwise distance, in epsilons of the format, of fpemu's float32-rounded-once model from torch's CPU
# kernel in that format, at least and at most, per oneDNN tier (the zoo's calls, seeded): for oneDNN's
# AVX512_BF16 kernels as docs/emulate_torch.md publishes them (reports/emulate_op_bounds.md); for its AVX2
# kernels as measured on an AMD EPYC with avx2/fma/f16c only (2026-12-07, torch 2.13.0+cpu: bf16
# convolution_backward 0.397, attention 0.114 / 0.352; fp16 convolution 0.014, its backward 0.399,
# attention 0.153 / 0.338).  The fused attention rounds inside, so it departs by at least the lower bound.
_CONV, _SDPA = "aten::convolution", "aten::_scaled_dot_product_flash_attention_for_cpu"
NORMWISE_BOUNDS = {
    ("bf16", "AVX512_BF16"): {_CONV: (0.0, 0.05), f"{_CONV}_backward": (0.0, 0.05), _SDPA: (0.1, 0.6),
                              f"{_SDPA}_backward": (0.1, 0.6)},
    ("bf16", "AVX2"): {_CONV: (0.0, 0.05), f"{_CONV}_backward": (0.3, 0.45), _SDPA: (0.05, 0.25),
                       f"{_SDPA}_backward": (0.25, 0.45)},
    ("fp16", "AVX2"): {_CONV: (0.0, 0.05), f"{_CONV}_backward": (0.3, 0.45), _SDPA: (0.1, 0.25),
                       f"{_SDPA}_backward": (0.25, 0.45)},
}


# oneDNN's CPU ISAs in its order (ONEDNN_MAX_CPU_ISA's names; AVX512_CORE_FP16 is AVX10_1_512's alias)
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16")


def _onednn_cap() -> str:
    """oneDNN's ISA cap as _ONEDNN_ISAS names it (ONEDNN_MAX_CPU_ISA, else DNNL_MAX_CPU_ISA), or ALL."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return {"AVX10_1_512": "AVX512_CORE_FP16", "AVX10_1_512_AMX": "AVX512_CORE_AMX"}.get(cap, cap)


def _onednn_runs_fp16_isa() -> bool:
    """Whether oneDNN runs its AVX512_CORE_FP16 kernels or newer: the CPU has AVX512-FP16 and
    ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) does not cap it below."""
    from fpemu.host import cpu_flags
    cap = _onednn_cap()
    allowed = cap == "ALL" or (cap in _ONEDNN_ISAS and _ONEDNN_ISAS.index(cap) >= _ONEDNN_ISAS.index("AVX512_CORE_FP16"))
    return "avx512_fp16" in cpu_flags() and allowed


def _onednn_computes_bf16() -> bool:
    from fpemu.host import torch_cpu_tiers
    return bool(torch_cpu_tiers()["onednn_bf16"])


def _onednn_tier(fmt: str) -> str:
    """The oneDNN tier the zoo's ``fmt`` kernels run on, as NORMWISE_BOUNDS names it ('' where none was measured)."""
    from fpemu.host import cpu_flags
    cap = _onednn_cap()
    capped_to_avx2 = cap in _ONEDNN_ISAS and _ONEDNN_ISAS.index(cap) <= _ONEDNN_ISAS.index("AVX2")
    if fmt == "bf16" and _onednn_computes_bf16() and not capped_to_avx2:
        return "AVX512_BF16"
    flags = cpu_flags()
    at_avx2 = capped_to_avx2 or not ({"avx512f", "avx_vnni", "avx_ne_convert"} & set(flags))
    return "AVX2" if at_avx2 and "avx2" in flags else ""


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_published_bounds_of_the_float32_model_hold_on_the_zoo(fmt):
    tier = _onednn_tier(fmt)
    if (fmt, tier) not in NORMWISE_BOUNDS:
        pytest.skip(f"no {fmt} bounds measured for the oneDNN kernels this CPU runs (measured: "
                    f"{', '.join(f'{f} on {t}' for f, t in NORMWISE_BOUNDS)})")
    from benchmarks.emulate_op_bounds import EPSILON, gaps
    bounds = NORMWISE_BOUNDS[(fmt, tier)]
    measured = gaps([call for call in _recorded_calls(fmt) if call[0] in bounds], LOW[fmt], torch)
    for name, (least, most) in bounds.items():
        assert least <= measured[name][3] / EPSILON[fmt] <= most, (name, tier, measured[name])
