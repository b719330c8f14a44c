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
        if command != ["env"]:
            assert "exit codes:\n  0  success" in proc.stdout and "3  an internal error" in proc.stdout
            assert "spec format:" in proc.stdout and "api changed" in proc.stdout


def test_python_dash_m_and_version():
    proc = subprocess.run([sys.executable, "-m", "fpemu", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"fpemu {__import__('fpemu').__version__}"
    proc = subprocess.run([sys.executable, "-m", "fpemu", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2


def cli(capsys, *argv):
    code = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_quiet_summarises_written_files_and_run_outside_the_checkout_says_what_to_do(capsys, tmp_path,
                                                                                      monkeypatch):
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("timing_torch", "timing_flax", "timing_apex", "floor_jmp", "seed_example_1"):
        shutil.copy(SPECS / f"{name}.toml", specs)
    golden = tmp_path / "golden"
    code, out, _ = cli(capsys, "golden", specs, "--out", golden, "--quiet")
    assert code == 0 and out == f"wrote 5 golden traces under {golden}\n"
    code, out, _ = cli(capsys, "golden", SPECS / "timing_torch.toml", "--out", golden)
    assert out == f"wrote {golden / 'timing_torch.json'}\n"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, err = cli(capsys, "run")
    assert code == 2 and "specs: no such spec file or folder in the current folder" in err
    assert "run it from the checkout's root, or pass --specs FOLDER" in err
    code, _, err = cli(capsys, "report", "--golden", golden, "--reports", tmp_path / "reports")
    assert code == 0 and "no --diff" in err and "fpemu diff ... --json > diff.json" in err
    harness = (tmp_path / "reports" / "harness.md").read_text()
    assert "**no comparisons: pass `--diff` with the results of `fpemu diff ... --json > diff.json`" in harness


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plots_keep_bars_visible_series_apart_and_name_the_divergent_field():
    pytest.importorskip("matplotlib")
    from fpemu.reports import plots
    fig = plots.draw_ulp_histogram("t", {"jax_step@cpu: loss": [0] * 30 + [1] * 8 + [300],
                                         "jax_step@cpu: params": [0] * 39})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.axes[0].get_legend().get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for patch in fig.axes[0].patches]
    assert bars and not any(_overlap(legend, bar) for bar in bars)
    plots._pyplot().close(fig)

    underflow = [0.6] * 20
    overflow = [0.0] * 20
    overflow[7] = 0.001  # a blip of 0.1%
    fig = plots.draw_shares_per_step("t", {"underflow": underflow, "subnormal": [0.0] * 20, "overflow": overflow})
    assert len(fig.axes) == 3  # one panel each: nothing drawn over anything else
    over = fig.axes[2]
    assert over.get_ylim()[1] < 0.2 and over.get_ylim()[1] > 0.1  # the blip fills its own panel
    assert any("0 at every step" in t.get_text() for t in fig.axes[1].texts)
    plots._pyplot().close(fig)

    fig = plots.draw_scale_trajectories("t", {"reference": [16.0] * 6, "flax@cpu": [16.0] * 3 + [32.0] * 3},
                                        [False] * 6, {"flax@cpu": (2, "growth_counter")})
    ax = fig.axes[0]
    assert any(t.get_text() == "step 2: growth_counter" for t in ax.texts)
    assert "flax@cpu (differs from step 2, growth_counter)" in [t.get_text() for t in ax.get_legend().get_texts()]
    plots._pyplot().close(fig)
