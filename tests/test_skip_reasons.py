"""An adapter that cannot run names every missing part at once: TE's specs said only "pydantic not
installed" where TransformerEngine's source was missing too."""

import importlib.util

import pytest

from fpemu.adapters import unavailable_reason


@pytest.fixture
def no_te_source(monkeypatch, tmp_path):
    monkeypatch.setenv("FPEMU_TE_SOURCE", str(tmp_path / "no-checkout"))


def hide(monkeypatch, *modules):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


@pytest.mark.parametrize("adapter", ["te_unfused", "te_reference"])
def test_missing_module_and_missing_source_are_both_named(monkeypatch, no_te_source, adapter):
    hide(monkeypatch, "pydantic")
    reason = unavailable_reason(adapter)
    assert reason.startswith("pydantic not installed; no TransformerEngine source at "), reason
    assert "FPEMU_TE_SOURCE" in reason


def test_missing_source_alone_and_module_alone(monkeypatch, no_te_source):
    assert unavailable_reason("te_unfused").startswith("no TransformerEngine source at ")
    assert unavailable_reason("te_block_reference").startswith("no TransformerEngine reference source (")
    hide(monkeypatch, "torch")
    assert unavailable_reason("te_block_reference").startswith("torch not installed; no TransformerEngine reference")


def test_a_deepspeed_tree_without_its_requirements_names_them(monkeypatch, tmp_path):
    """The 0.17.0 tree is installed --no-deps: where its requirements are absent the jobs skip naming them,
    instead of a worker dying at import (ModuleNotFoundError: hjson) as several failures."""
    tree = tmp_path / "deepspeed-0.17.0"
    (tree / "deepspeed").mkdir(parents=True)
    (tree / "deepspeed" / "__init__.py").write_text("")
    info = tree / "deepspeed-0.17.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.17.0\n"
                                   "Requires-Dist: numpy\nRequires-Dist: fpemu-no-such-package>=1\n"
                                   "Requires-Dist: fpemu-no-such-extra; extra == \"dev\"\n")
    monkeypatch.setenv("FPEMU_DEEPSPEED_0_17", str(tree))
    reason = unavailable_reason("deepspeed_0_17")
    assert reason == (f"the DeepSpeed tree at {tree} needs fpemu-no-such-package, not installed here (pip install "
                      "fpemu-no-such-package, or the deepspeed extra: pip install 'fpemu[deepspeed]')")
