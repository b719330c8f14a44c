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
import fpemu.kinds.blocks.trace
import fpemu.kinds.recipe.spec
import fpemu.traces.layout
import fpemu.scalers.fp8_recipes
import fpemu.scalers.simulate

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_tour():
    result = doctest.testfile(str(ROOT / "README.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5


@pytest.mark.parametrize("guide", ["fp8_recipes.md", "blocks.md"])
def test_guide_examples(guide):
    result = doctest.testfile(str(ROOT / "docs" / guide), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("module", [fpemu.formats.format, fpemu.formats.rounding, fpemu.formats.stats,
                                    fpemu.formats.packing, fpemu.blocks.quantize, fpemu.blocks.stats, fpemu.blocks.probes,
                                    fpemu.scalers.simulate, fpemu.scalers.fp8_recipes, fpemu.kinds.recipe.spec,
                                    fpemu.traces.layout, fpemu.kinds.blocks.trace,
                                    fpemu.compare.diff])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
