"""The README's tour and the docstring examples are real output."""

import doctest
import pathlib

import pytest

import fpemu.blocks.probes
import fpemu.blocks.quantize
import fpemu.blocks.stats
import fpemu.compare.diff
import fpemu.formats.format
import fpemu.formats.packing
import fpemu.formats.rounding
import fpemu.formats.stats
import fpemu.harness._blocks
import fpemu.harness._fp8_training
import fpemu.traces.layout
import fpemu.scalers.fp8_recipes
import fpemu.scalers.simulate
import fpemu.specs.recipes

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_tour():
    result = doctest.testfile(str(ROOT / "README.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5


@pytest.mark.parametrize("guide", ["fp8_recipes.md", "blocks.md", "emulate.md"])
def test_guide_examples(guide):
    result = doctest.testfile(str(ROOT / "docs" / guide), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("module", [fpemu.formats.format, fpemu.formats.rounding, fpemu.formats.stats,
                                    fpemu.formats.packing, fpemu.blocks.quantize, fpemu.blocks.stats, fpemu.blocks.probes,
                                    fpemu.scalers.simulate, fpemu.scalers.fp8_recipes, fpemu.specs.recipes,
                                    fpemu.traces.layout, fpemu.harness._fp8_training, fpemu.harness._blocks,
                                    fpemu.compare.diff])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
