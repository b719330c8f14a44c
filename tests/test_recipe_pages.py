"""reports/recipes/: every page regenerates to the committed bytes, and every recipe and block rule has one.

On a mismatch the regenerated page is written beside the golden as ``<page>.md.obtained`` (or
``.json.obtained``) and the test fails; ``python -m benchmarks.recipe_pages`` rewrites them all.
A page whose real code cannot run here (torchao or TE's source absent) is skipped with the reason.
"""

import pytest

from benchmarks import recipe_pages
from fpemu.blocks import SCALE_RULES
from fpemu.scalers.fp8_recipes import RECIPES

PAGES = recipe_pages.pages()
_BUILT = {}  # stem -> (markdown, result): each page is built once per session


def _built(stem: str) -> tuple:
    if stem not in _BUILT:
        _BUILT[stem] = recipe_pages.build(PAGES[stem])
    return _BUILT[stem]


def _skip_unless_runnable(stems) -> None:
    skipped = {name: reason for stem in stems for name, reason in recipe_pages.not_run(PAGES[stem]).items()}
    if skipped:
        pytest.skip("; ".join(f"{name}: {reason}" for name, reason in sorted(skipped.items())))


def _check_golden(path, obtained: str) -> None:
    golden = path.read_text(encoding="utf-8") if path.is_file() else None
    spill = path.with_name(path.name + ".obtained")
    if golden == obtained:
        spill.unlink(missing_ok=True)
        return
    spill.write_text(obtained, encoding="utf-8")
    pytest.fail(f"{path.name} differs from its regeneration, written to {spill}; if the change is meant, "
                "rerun python -m benchmarks.recipe_pages")


def test_every_recipe_and_block_rule_has_a_page():
    covered = [name for page in PAGES.values() for name in page.members]
    assert sorted(covered) == sorted([*RECIPES, *SCALE_RULES])
    assert len(covered) == len(set(covered))
    for stem in PAGES:
        assert (recipe_pages.PAGES_DIR / f"{stem}.md").is_file(), f"no page {stem}.md: run benchmarks.recipe_pages"
    index = (recipe_pages.PAGES_DIR / "README.md").read_text(encoding="utf-8")
    assert all(f"]({stem}.md)" in index for stem in PAGES)


def test_a_recipes_paths_share_a_page():
    assert PAGES["te_delayed"].members == ("te_delayed", "te_delayed_unfused")
    assert PAGES["torchao_rowwise"].members == ("torchao_rowwise",)


@pytest.mark.parametrize("stem", list(PAGES))
def test_page_regenerates_to_the_committed_bytes(stem):
    _skip_unless_runnable([stem])
    markdown, result = _built(stem)
    _check_golden(recipe_pages.PAGES_DIR / f"{stem}.md", markdown)
    _check_golden(recipe_pages.PAGES_DIR / f"{stem}.json", recipe_pages.as_json(result))
    assert recipe_pages.real_mismatches(result) in (None, 0)  # the model is the real code, bit for bit


def test_index_regenerates_to_the_committed_bytes():
    _skip_unless_runnable(PAGES)
    results = {stem: _built(stem)[1] for stem in PAGES}
    _check_golden(recipe_pages.PAGES_DIR / "README.md", recipe_pages.index(results))


def test_exact_scale_is_the_correctly_rounded_quotient():
    from fpemu.scalers import fp8_recipes as rec
    scales = recipe_pages.exact_scale(rec.CurrentScaling(power_2_scales=True), [3.0, 1e-45, float("inf")])
    assert scales[0] == 128.0 and scales[1] == 2.0 ** 127 and scales[2] != scales[2]  # floor; FLT_MAX floored; none
    assert recipe_pages.exact_scale(rec.DelayedScaling(margin=1), [117.0])[0] == rec.np.float32(224.0 / 117.0)
