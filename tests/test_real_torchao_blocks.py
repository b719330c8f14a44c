"""fpemu.block_quantize against the real torchao 0.18 on the CPU, bit for bit: scale codes, element
codes and dequantized values, every element format x scale mode x input kind, and NVFP4 at one and
two levels.  (The larger sweep: benchmarks/blocks_torchao_sweep.py.)"""

import os
import subprocess
import sys

import numpy as np
import pytest

import fpemu.blocks as blocks
from fpemu.blocks.probes import PROBE_KINDS, probe_blocks

pytest.importorskip("torchao")
from fpemu.adapters.torchao_blocks import torchao_block_quantize  # noqa: E402

MX_RULES = ["torchao_floor", "torchao_ceil", "torchao_even", "torchao_rceil"]
NVFP4_RULES = ["torchao_nvfp4", "torchao_nvfp4_2level"]
CASES = [(rule, elem) for rule in MX_RULES + NVFP4_RULES for elem in blocks.SCALE_RULES[rule].elements]


def same_bits_nan_aware(a, b) -> np.ndarray:
    """Elementwise: equal float32 bit patterns, or both NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def mismatches(ours, theirs) -> dict:
    return {"scale_codes": int(np.count_nonzero(ours.scale_codes != theirs.scale_codes)),
            "element_codes": int(np.count_nonzero(ours.element_codes != theirs.element_codes)),
            "values": int(np.count_nonzero(~same_bits_nan_aware(ours.values, theirs.values))),
            "scales": int(np.count_nonzero(~same_bits_nan_aware(ours.scales, theirs.scales)))}


@pytest.mark.parametrize("kind", PROBE_KINDS)
@pytest.mark.parametrize("rule,elem", CASES)
def test_block_quantize_matches_torchao_bit_for_bit(rule, elem, kind):
    x = probe_blocks(kind, elem, rows=16, block_size=32, seed=3)
    ours, theirs = blocks.block_quantize(x, elem, scale_rule=rule), torchao_block_quantize(x, elem, rule)
    assert mismatches(ours, theirs) == {"scale_codes": 0, "element_codes": 0, "values": 0, "scales": 0}
    assert same_bits_nan_aware(np.float32(ours.tensor_scale or 0), np.float32(theirs.tensor_scale or 0))


@pytest.mark.parametrize("rule,elem", CASES)
def test_block_quantize_matches_torchao_on_cuda(rule, elem):
    """torchao's eager code on CUDA tensors (the CPU's model, unchecked on a GPU so far): skips without CUDA."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    for kind in PROBE_KINDS:
        x = probe_blocks(kind, elem, rows=16, block_size=32, seed=3)
        ours, theirs = blocks.block_quantize(x, elem, scale_rule=rule), torchao_block_quantize(x, elem, rule, "cuda")
        assert mismatches(ours, theirs) == {"scale_codes": 0, "element_codes": 0, "values": 0, "scales": 0}, kind


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def torch_threads(request):
    """torch's intra-op pool at 1 and at 2 threads (this machine's cores), restored after."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(threads)


GRAIN = 32768  # at::internal::GRAIN_SIZE: past it, torch's max folds the threads' results with its scalar max


@pytest.mark.parametrize("size", [GRAIN - 16, GRAIN, GRAIN + 16, 2 * GRAIN, 2 * GRAIN + 16, 3 * GRAIN])
def test_two_level_nvfp4_with_a_nan_matches_torchao_past_the_grain_size(size, torch_threads):
    """The tensor amax's NaN bits reach torchao's fp4 codes (0xFFFFFFFF -> 0xC, 0x7FC00000 -> 0x3): with 2
    threads past 32,768 values torch's max gives 0x7FC00000 (every code differed from 0xC's model)."""
    x = probe_blocks("random", "fp4_e2m1fn", rows=size // 16, block_size=16, seed=size)
    x[3, 5], x[-1, -1] = np.nan, -np.nan
    ours = blocks.block_quantize(x, "fp4_e2m1fn", scale_rule="torchao_nvfp4_2level", torch_threads=torch_threads)
    theirs = torchao_block_quantize(x, "fp4_e2m1fn", "torchao_nvfp4_2level")
    assert mismatches(ours, theirs) == {"scale_codes": 0, "element_codes": 0, "values": 0, "scales": 0}
    assert int(ours.element_codes[0, 0]) == (0x3 if size > GRAIN and torch_threads > 1 else 0xC)


def test_torch_max_all_nan_bits_are_torchs(torch_threads):
    """torch.max (no dim) of a NaN-holding float32 tensor: the model's bits at every size class around
    the grain size, the NaN first, second, in the middle and last, quiet and signalling, both signs."""
    import torch
    from fpemu.blocks.quantize import torch_max_all_nan_bits
    for size in (2, 15, 16, 17, 33, GRAIN - 1, GRAIN, GRAIN + 1, 2 * GRAIN, 2 * GRAIN + 1, 3 * GRAIN + 7):
        for at in sorted({0, 1, size // 2, size - 1}):
            for nan in (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFC12345):
                x = np.ones(size, np.float32)
                x[at] = np.array(nan, np.uint32).view(np.float32)
                got = np.float32(torch.from_numpy(x).abs().max().item()).view(np.uint32)
                assert int(got) == torch_max_all_nan_bits(size, torch_threads), (size, at, hex(nan))


def test_torch_max_all_nan_bits_are_the_same_on_torchs_avx2_tier():
    """The AVX2 kernels' maximum ORs the same all-ones mask as AVX512's (ATEN_CPU_CAPABILITY=avx2)."""
    code = ("import numpy as np, torch\n"
            "for threads in (1, 2):\n"
            "    torch.set_num_threads(threads)\n"
            "    for size in (16, 32768, 32769):\n"
            "        x = np.ones(size, np.float32); x[size // 2] = np.nan\n"
            "        print(torch.backends.cpu.get_cpu_capability(), threads, size,\n"
            "              hex(np.float32(torch.from_numpy(x).abs().max().item()).view(np.uint32)))\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:6] == ["AVX2 1 16 0xffffffff", "AVX2 1 32768 0xffffffff", "AVX2 1 32769 0xffffffff",
                                    "AVX2 2 16 0xffffffff", "AVX2 2 32768 0xffffffff", "AVX2 2 32769 0x7fc00000"]


def test_fp4_codes_pack_as_torchao_stores_them():
    import torch
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    x = probe_blocks("random", "fp4_e2m1fn", rows=4, block_size=32, seed=5)
    _, packed = to_mx(torch.from_numpy(x), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    ours = blocks.block_quantize(x, "fp4_e2m1fn", scale_rule="torchao_floor")
    assert np.array_equal(ours.packed_codes, packed.view(torch.uint8).numpy())


def test_torchao_departures_from_exact_arithmetic_are_the_documented_ones():
    """Byte-0 blocks: FLOOR dequantizes to half, RCEIL flushes to 0, the exact OCP rule keeps them;
    RCEIL's float32 log2 loses the round-up just above 448 * 2**-20; an inf in a FLOOR block gives 2**120."""
    tiny = np.full((1, 32), 2.0**-125, np.float32)
    floor = blocks.block_quantize(tiny, "fp8_e4m3fn", scale_rule="torchao_floor")
    assert int(floor.scale_codes[0, 0]) == 0 and floor.values[0, 0] == np.float32(2.0**-126)
    assert blocks.block_quantize(tiny, "fp8_e4m3fn", scale_rule="torchao_rceil").values.max() == 0
    assert blocks.block_quantize(tiny, "fp8_e4m3fn", scale_rule="ocp").values[0, 0] == np.float32(2.0**-125)
    edge = np.zeros((1, 32), np.float32)
    edge[0, 0] = np.nextafter(np.float32(448 * 2.0**-20), np.float32(1))
    rceil = blocks.block_quantize(edge, "fp8_e4m3fn", scale_rule="torchao_rceil")
    assert int(rceil.scale_codes[0, 0]) == 127 - 20       # exact ceil: -19
    assert int(torchao_block_quantize(edge, "fp8_e4m3fn", "torchao_rceil").scale_codes[0, 0]) == 127 - 20
    with_inf = probe_blocks("random", "fp8_e4m3fn", rows=1, seed=0)
    with_inf[0, 3] = np.inf
    inf_block = blocks.block_quantize(with_inf, "fp8_e4m3fn", scale_rule="torchao_floor")
    assert int(inf_block.scale_codes[0, 0]) == 127 + 120 and np.isinf(inf_block.values[0, 3])
    assert np.count_nonzero(inf_block.values) == 1


def test_torchao_blocks_is_a_row_of_the_adapter_table():
    from fpemu.adapters import BLOCKS, get_adapter, unavailable_reason
    adapter = get_adapter("torchao_blocks")
    assert adapter.kind == BLOCKS and unavailable_reason("torchao_blocks") is None
    assert adapter.function() is torchao_block_quantize
