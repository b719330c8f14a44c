"""The README's tour and the docstring examples are real output."""

import doctest
import pathlib
import re

import pytest

import fpemu.blocks.probes
import fpemu.blocks.quantize
import fpemu.blocks.stats
import fpemu.compare.diff
import fpemu.compare.readings
import fpemu.formats.format
import fpemu.formats.packing
import fpemu.formats.rounding
import fpemu.formats.stats
import fpemu.kinds.blocks.trace
import fpemu.kinds.recipe.spec
import fpemu.traces.layout
import fpemu.traces.plain
import fpemu.pytest_plugin
import fpemu.environments
import fpemu.scalers.fp8_recipes
import fpemu.scalers.simulate

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_tour():
    result = doctest.testfile(str(ROOT / "README.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5


DOCTEST_PAGES = sorted(page.name for page in (ROOT / "docs").glob("*.md") if ">>> " in page.read_text())


@pytest.mark.parametrize("guide", DOCTEST_PAGES)
def test_guide_examples(guide):
    result = doctest.testfile(str(ROOT / "docs" / guide), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_the_reference_pages_are_doctested():
    assert {"formats.md", "scalers.md", "blocks.md", "fp8_recipes.md", "steps.md", "ranks.md", "kinds.md"} <= set(
        DOCTEST_PAGES)


def test_readme_is_a_front_door_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    pages = sorted(page.name for page in (ROOT / "docs").glob("*.md"))
    for page in pages:  # every reference page is reachable from the README
        assert f"docs/{page}" in text, f"README.md does not link docs/{page}"
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_the_api_page_lists_exactly_the_public_surface():
    import fpemu
    listed = re.findall(r"^\| `([A-Za-z_]+)` \|", (ROOT / "docs" / "api.md").read_text(), re.M)
    assert sorted(listed) == sorted(name for name in fpemu.__all__ if name != "__version__")
    assert len(listed) == len(set(listed))


def test_readme_layout_lists_the_layers_of_the_layering_test():
    from test_layering import LAYERS
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```")[1]
    listed = [line.split()[0] for line in block.strip().splitlines()]
    assert listed == [name.split()[0] for name, _ in LAYERS]


@pytest.mark.parametrize("module", [fpemu.formats.format, fpemu.formats.rounding, fpemu.formats.stats,
                                    fpemu.formats.packing, fpemu.blocks.quantize, fpemu.blocks.stats, fpemu.blocks.probes,
                                    fpemu.scalers.simulate, fpemu.scalers.fp8_recipes, fpemu.kinds.recipe.spec,
                                    fpemu.traces.layout, fpemu.kinds.blocks.trace,
                                    fpemu.compare.diff, fpemu.compare.readings, fpemu.traces.plain,
                                    fpemu.pytest_plugin, fpemu.environments])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
