import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from fpemu.cli import build_parser, main

SPECS = pathlib.Path(__file__).resolve().parent.parent / "specs"


@pytest.mark.fpemu_torch
@pytest.mark.fpemu_flax
def test_run_writes_reports(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("seed_example_1", "flax_vs_torch_timing", "hysteresis_megatron"):
        shutil.copy(SPECS / f"{name}.toml", specs)
    reports = tmp_path / "reports"
    assert main(["run", "--specs", str(specs), "--reports", str(reports), "--quiet", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {v["status"] for v in result["verdicts"]} == {"match", "known divergence"}
    assert "| fp8_e4m3fn | 1-4-3 | 7 | fn | 448 |" in (reports / "formats.md").read_text()
    harness = (reports / "harness.md").read_text()
    assert "| [flax_vs_torch_timing](#flax_vs_torch_timing) | flax@cpu | known divergence | step 2, growth_counter" in harness
    for png in ("profiles.png", "seed_example_1.png", "flax_vs_torch_timing.png"):
        assert (reports / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    assert "[harness.md](harness.md)" in (reports / "README.md").read_text()
    leftovers = [p for p in reports.rglob(".*")]
    assert not leftovers, f"temporary files left behind: {leftovers}"


def test_console_script_usage_error_exits_2():
    proc = subprocess.run([sys.executable, "-m", "fpemu.cli", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fpemu.cli", "golden"], capture_output=True, text=True)
    assert proc.returncode == 2 and "required" in proc.stderr


def test_help_on_every_command():
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"golden", "record", "diff", "audit", "report", "run", "env"}
    for command in [[], *([c] for c in commands)]:
        proc = subprocess.run([sys.executable, "-m", "fpemu.cli", *command, "--help"], capture_output=True, text=True)
        assert proc.returncode == 0 and "usage: fpemu" in proc.stdout


def test_python_dash_m_and_version():
    proc = subprocess.run([sys.executable, "-m", "fpemu", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"fpemu {__import__('fpemu').__version__}"
    proc = subprocess.run([sys.executable, "-m", "fpemu", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2
