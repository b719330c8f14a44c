"""fpemu.blocks.stats.block_stats and `fpemu underflow --block-rule`: what block quantization loses."""

import json

import numpy as np
import pytest

from fpemu.blocks import SCALE_RULES
from fpemu.blocks.stats import block_stats
from fpemu.cli import main


def test_counts_of_a_hand_built_ocp_tensor():
    # block 0: amax 500 gives scale 2**(8 - 8) = 1: 500 is beyond 448 (saturated); 2**-7 is an e4m3
    # subnormal (min normal 2**-6); 2**-11 is below half the least subnormal 2**-9 (underflow).
    # block 1: NaN and inf give OCP's NaN scale; its zero counts as a zero input.
    x = np.array([[500.0, -2.0**-7, 2.0**-11, 1.0], [np.nan, np.inf, 0.0, 3.0]], np.float32).reshape(1, 8)
    stats = block_stats(x, "fp8_e4m3fn", block_size=4)
    assert (stats.total, stats.zeros, stats.nan, stats.inf) == (8, 1, 1, 1)
    assert (stats.underflow, stats.subnormal, stats.saturated) == (1, 1, 1)
    assert (stats.blocks, stats.flushed_blocks, stats.nan_scale_blocks) == (2, 0, 1)
    # over the elements whose input and value are both finite (block 0 only: block 1's values are NaN)
    error = np.sqrt((52.0**2 + 2.0**-22) / (500.0**2 + 2.0**-14 + 2.0**-22 + 1.0))
    assert stats.relative_rms_error == pytest.approx(error, rel=1e-12)  # float64 sums of four terms
    assert stats.share("saturated") == 1 / 8 and stats.share("nan_scale_blocks") == 1 / 2


def test_one_level_nvfp4_flushes_a_small_tensor_and_two_levels_keep_it():
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32) * 1e-3
    one, two = (block_stats(x, "fp4_e2m1fn", scale_rule=rule) for rule in ("torchao_nvfp4", "torchao_nvfp4_2level"))
    assert (one.underflow, one.flushed_blocks, one.blocks, one.relative_rms_error) == (4096, 256, 256, 1.0)
    assert two.flushed_blocks == 0 and two.underflow < 0.1 * two.total and two.relative_rms_error < 0.15


def test_blocks_along_another_axis_count_as_the_transposed_tensor():
    spread = np.exp2(np.arange(64) % 7 * 3.0)[:, None]
    x = (np.random.default_rng(1).standard_normal((64, 32)) * spread).astype(np.float32)
    assert block_stats(x, "fp6_e3m2fn", axis=0) == block_stats(np.ascontiguousarray(x.T), "fp6_e3m2fn")


@pytest.mark.parametrize("rule", sorted(SCALE_RULES))
def test_every_rule_measures_an_empty_tensor_and_a_zero_block(rule):
    elem = SCALE_RULES[rule].elements[0]
    size = SCALE_RULES[rule].block_size
    empty = block_stats(np.zeros((0, size), np.float32), elem, scale_rule=rule)
    assert (empty.total, empty.blocks) == (0, 0) and np.isnan(empty.relative_rms_error)
    zeros = block_stats(np.zeros((1, size), np.float32), elem, scale_rule=rule)
    assert (zeros.zeros, zeros.underflow, zeros.flushed_blocks) == (size, 0, 0)


def test_underflow_command_with_a_block_rule(capsys, tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "w.npz", small=rng.standard_normal((64, 64)).astype(np.float32) * 1e-3,
             odd=np.ones((3, 7), np.float32))
    assert main(["underflow", str(tmp_path / "w.npz"), "--format", "fp4_e2m1fn", "--block-rule", "torchao_nvfp4",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["arrays"]
    assert (row["array"], row["flushed_blocks_share"], row["underflow_share"]) == ("w.npz:small", 1.0, 1.0)
    assert result["block_rule"] == "torchao_nvfp4" and result["block_size"] == 16
    assert result["notes"] == ["w.npz:odd: left out, x: axis 1 has length 7, not a multiple of block_size=16"]
    for argv, words in ((["--format", "fp8_e4m3fn", "--block-rule", "nope"], "--block-rule nope: unknown scale rule"),
                        (["--format", "bf16", "--block-rule", "ocp"], "--format bf16: scale rule ocp takes"),
                        (["--format", "fp8_e4m3fn", "--block-rule", "ocp", "--overflow", "saturate"],
                         "drop --overflow"),
                        (["--format", "fp8_e4m3fn", "--block-rule", "ocp", "--block-size", "0"],
                         "--block-size 0: expected a positive")):
        assert main(["underflow", str(tmp_path / "w.npz"), *argv]) == 2 and words in capsys.readouterr().err, argv
