import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from fpemu.cli import build_parser, main
from fpemu.figures import pyplot

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
    megatron = importlib.util.find_spec("megatron") is not None  # megatron-core: a stage-2 extra
    assert {v["status"] for v in result["verdicts"]} == {"match", "known divergence"} | (set() if megatron else {"skipped"})
    assert "| fp8_e4m3fn | 1-4-3 | 7 | fn | 448 |" in (reports / "formats.md").read_text()
    harness = (reports / "harness.md").read_text()
    assert "| [flax_vs_torch_timing](#flax_vs_torch_timing) | flax@cpu | known divergence | step 2, growth_counter" in harness
    for png in ("profiles.png", "seed_example_1.png", "flax_vs_torch_timing.png"):
        assert (reports / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    assert "[harness.md](harness.md)" in (reports / "README.md").read_text()
    leftovers = [p for p in reports.rglob(".*")]
    assert not leftovers, f"temporary files left behind: {leftovers}"


def test_console_script_usage_error_exits_2(capsys):
    # the process's exit code through fpemu.cli's __main__ (python -m fpemu's: test_python_dash_m_and_version)
    proc = subprocess.run([sys.executable, "-m", "fpemu.cli", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    with pytest.raises(SystemExit) as usage:  # argparse's own exit, in this process
        main(["golden"])
    assert usage.value.code == 2 and "required" in capsys.readouterr().err


def test_help_on_every_command(capsys):
    # in-process (a subprocess per command took 10 s); the entry points run as processes below
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"golden", "record", "diff", "audit", "compare", "report", "run", "simulate", "underflow",
                             "env", "recipe", "emulate", "matrix", "bisect", "merge", "ranks", "merge-traces"}
    for command in [[], *([c] for c in commands)]:
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0 and "usage: fpemu" in out, command
        if command != ["env"]:
            assert "exit codes:\n  0  success" in out and "3  an internal error" in out
            assert "spec format:" in out and "api changed" in out


def test_python_dash_m_and_version():
    proc = subprocess.run([sys.executable, "-m", "fpemu", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"fpemu {__import__('fpemu').__version__}"


def cli(capsys, *argv):
    code = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_prints_a_table_per_step_and_json(capsys):
    import fpemu
    code, out, _ = cli(capsys, "simulate", "--profile", "torch", "--overflow-steps", "3,7-8", "--steps", "20",
                       "--param", "init_scale=1024", "--param", "growth_interval=2")
    expected = fpemu.simulate_scaler([i in (3, 7, 8) for i in range(20)], "torch", init_scale=1024.0,
                                     growth_interval=2)
    rows = [line.split() for line in out.splitlines() if " applied " in line or " skipped " in line]
    assert code == 0 and len(rows) == 20
    assert [float(r[2] if r[1] == "X" else r[1]) for r in rows] == expected.scales
    assert [r[0] for r in rows if r[1] == "X"] == ["3", "7", "8"]
    assert f"final scale {expected.final_scale:.9g}" in out and "17 updates applied, 3 skipped" in out
    code, out, _ = cli(capsys, "simulate", "--profile", "flax", "--overflow-steps", "1", "--param", "scale=2**4",
                       "--json")
    result = json.loads(out)
    assert code == 0 and [s["scale"] for s in result["steps"]] == [16.0, 16.0]
    assert result["summary"]["final_scale"] == 8.0 and result["params"]["scale"] == 16.0
    for argv, words in ((["--profile", "pytorch"], "--profile pytorch: unknown profile"),
                        (["--param", "period=3"], "has no parameter 'period'"),
                        (["--param", "init_scale"], "expected NAME=VALUE"),
                        (["--overflow-steps", "3,x"], "expected step numbers"),
                        (["--overflow-steps", "9", "--steps", "5"], "step 9 is past the last step")):
        code, _, err = cli(capsys, "simulate", *argv)
        assert code == 2 and words in err, (argv, err)


def test_underflow_of_tensor_files(capsys, tmp_path):
    import numpy as np
    import torch
    import fpemu
    rng = np.random.default_rng(0)
    grads = (rng.standard_normal(10_000) * 1e-7).astype(np.float32)
    np.save(tmp_path / "g.npy", grads)
    np.savez(tmp_path / "layers.npz", embed=grads * 1e-3, head=grads * 1e9, steps=np.arange(3))
    torch.save({"layer": {"weight": torch.from_numpy(grads).to(torch.bfloat16)}, "step": 3}, tmp_path / "t.pt")
    code, out, _ = cli(capsys, "underflow", tmp_path / "g.npy", tmp_path / "layers.npz", tmp_path / "t.pt",
                       "--format", "fp16", "--scale", "1", "2**16", "--json")
    result = json.loads(out)
    rows = {(r["array"], r["scale"]): r for r in result["arrays"]}
    assert code == 0 and len(rows) == 8
    assert rows[("g.npy", 1.0)]["underflow_share"] == fpemu.range_stats(grads, "fp16").underflow_share > 0.2
    assert rows[("g.npy", 65536.0)]["underflow_share"] == 0.0
    assert rows[("layers.npz:head", 65536.0)]["overflow_share"] > 0.5
    assert ("t.pt:layer.weight", 1.0) in rows and rows[("t.pt:layer.weight", 1.0)]["dtype"] == "float32"
    assert result["notes"] == ["layers.npz:steps: left out, dtype int64 is not floating point"]
    code, out, _ = cli(capsys, "underflow", tmp_path / "g.npy", "--scale", "1024")
    assert code == 0 and "g.npy" in out and "underflow" in out.splitlines()[2]
    (tmp_path / "x.csv").write_text("1,2")
    for argv, words in (([tmp_path / "x.csv"], "unknown tensor file type '.csv'"),
                        ([tmp_path / "none.npy"], "none.npy: no such file"),
                        ([tmp_path / "g.npy", "--format", "fp17"], "--format fp17: unknown format"),
                        ([tmp_path / "g.npy", "--scale", "0"], "--scale 0: expected a positive")):
        code, _, err = cli(capsys, "underflow", *argv)
        assert code == 2 and words in err, (argv, err)


def test_pt_files_without_torch_are_refused_with_the_reason(capsys, tmp_path, monkeypatch):
    (tmp_path / "t.pt").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "torch", None)
    code, _, err = cli(capsys, "underflow", tmp_path / "t.pt")
    assert code == 2 and "t.pt: reading .pt files needs torch, which is not installed" in err


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
    pyplot().close(fig)

    underflow = [0.6] * 20
    overflow = [0.0] * 20
    overflow[7] = 0.001  # a blip of 0.1%
    fig = plots.draw_shares_per_step("t", {"underflow": underflow, "subnormal": [0.0] * 20, "overflow": overflow})
    assert len(fig.axes) == 3  # one panel each: nothing drawn over anything else
    over = fig.axes[2]
    assert over.get_ylim()[1] < 0.2 and over.get_ylim()[1] > 0.1  # the blip fills its own panel
    assert any("0 at every step" in t.get_text() for t in fig.axes[1].texts)
    pyplot().close(fig)

    fig = plots.draw_scale_trajectories("t", {"reference": [16.0] * 6, "flax@cpu": [16.0] * 3 + [32.0] * 3},
                                        [False] * 6, {"flax@cpu": (2, "growth_counter")})
    ax = fig.axes[0]
    assert any(t.get_text() == "step 2: growth_counter" for t in ax.texts)
    assert "flax@cpu (differs from step 2, growth_counter)" in [t.get_text() for t in ax.get_legend().get_texts()]
    pyplot().close(fig)


def test_run_rank_timeout_is_stated_in_help_and_checked_before_anything_runs(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0 and "--rank-timeout SECONDS seconds each [ranks] case may run before it counts as a hang" in out
    for bad in ("0", "-5", "inf", "nan"):
        code, _, err = cli(capsys, "run", "--specs", SPECS, "--reports", tmp_path / "reports", "--rank-timeout", bad)
        assert code == 2 and f"--rank-timeout {float(bad):g}: expected seconds > 0 (a finite number)" in err, bad
    assert not (tmp_path / "reports").exists()
    with pytest.raises(SystemExit) as done:
        main(["run", "--rank-timeout", "soon"])
    assert done.value.code == 2 and "--rank-timeout: invalid float value: 'soon'" in capsys.readouterr().err


def test_golden_diff_and_record_say_that_ranks_specs_run_under_fpemu_run(capsys, tmp_path):
    """[ranks] specs get their per-rank goldens and real ranks from `fpemu run`: golden, diff and record
    name the files they leave out; when nothing else was given there is nothing they can do (exit 2)."""
    ranks_spec = SPECS / "ranks_ddp_grad_scaler.toml"
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(ranks_spec, only)
    for command in (["golden", only, "--out", tmp_path / "golden"], ["diff", only, "--golden", tmp_path / "golden"],
                    ["record", only, "--out", tmp_path / "golden"]):
        code, out, err = cli(capsys, *command)
        assert code == 2 and out == "", command
        assert (f"{only / ranks_spec.name}: [ranks] spec, which `fpemu {command[0]}` does not run; "
                "`fpemu run --specs FOLDER_OR_FILE` writes their per-rank golden traces") in err, err
    assert not (tmp_path / "golden").exists()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(ranks_spec, mixed)
    shutil.copy(SPECS / "seed_example_1.toml", mixed)
    code, out, err = cli(capsys, "golden", mixed, "--out", tmp_path / "golden")
    assert code == 0 and out == f"wrote {tmp_path / 'golden' / 'seed_example_1.json'}\n"
    assert f"note: {mixed / ranks_spec.name}: [ranks] spec, which `fpemu golden` does not run" in err
    code, out, err = cli(capsys, "diff", mixed, "--golden", tmp_path / "golden")
    assert code == 0 and "seed_example_1 / torch@cpu" in out
    assert f"note: {mixed / ranks_spec.name}: [ranks] spec, which `fpemu diff` does not run" in err


def test_emulate_help_names_every_policy(capsys):
    """The help is derived from the policy table: fp8_delayed was missing from a hand-written list."""
    from fpemu.emulate.policy import POLICIES
    with pytest.raises(SystemExit):
        main(["emulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in POLICIES) and "jax: program (default)" in text


def test_torchaos_cuda_extension_warnings_are_dropped_and_nothing_else():
    import logging
    from fpemu.framework_logs import cuda_extension_noise

    def record(message):
        return logging.LogRecord("torchao", logging.WARNING, "torchao/__init__.py", 96, message, (), None)
    noise = "Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library"
    assert not cuda_extension_noise(record(noise))
    assert cuda_extension_noise(record("Skipping import of cpp extensions due to incompatible torch version"))
    main(["simulate", "--overflow-steps", "1", "--quiet"])
    assert cuda_extension_noise in logging.getLogger("torchao").filters


def test_compare_names_a_json_result_that_is_not_a_trace(tmp_path, capsys):
    assert main(["simulate", "--overflow-steps", "1", "--json"]) == 0
    result = tmp_path / "simulate.json"
    result.write_text(capsys.readouterr().out)
    assert main(["compare", str(result), str(result)]) == 2
    assert "not a trace file but a command's --json result" in capsys.readouterr().err


def test_torchs_enum_registration_warning_is_dropped_and_nothing_else():
    """torch 2.13 warns once per Enum that torchao registers as a pytree constant (seen on `fpemu golden specs`
    here, not on every run: it depends on what was imported before)."""
    import logging
    from fpemu.framework_logs import NOISE_FILTERS, enum_registration_noise

    def record(message):
        return logging.LogRecord("torch.utils._pytree", logging.WARNING, "_pytree.py", 630, message, (), None)
    assert not enum_registration_noise(record(
        "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque "
        "value type. Calling register_constant() on Enum subclasses is deprecated"))
    assert enum_registration_noise(record("some other pytree warning"))
    main(["simulate", "--overflow-steps", "1", "--quiet"])
    assert all(keep in logging.getLogger(name).filters for name, keep in NOISE_FILTERS.items())


ROOT_DIR = pathlib.Path(__file__).resolve().parents[1]
CHATTER = """
import argparse, logging, os, subprocess, sys
from fpemu.cli import output
logger = logging.getLogger("chatter")
logger.addHandler(logging.StreamHandler(sys.stdout))  # bound at import, as DeepSpeed's logger is
with output.stdout_for_results():
    print("python chatter")
    logger.warning("logger chatter")
    os.write(1, b"c chatter\\n")
    subprocess.run([sys.executable, "-c", "print('child chatter')"], check=True)
    output.emit(argparse.Namespace(json=True), {"verdict": "ok"}, [])
print("after")
"""


def test_stdout_carries_the_result_alone_whatever_else_writes_to_it():
    """What frameworks print while a command runs (DeepSpeed's logger, bound to stdout at import, logged
    'Setting accelerator to CPU' into `fpemu ranks --json`), C code and child processes go to stderr."""
    done = subprocess.run([sys.executable, "-c", CHATTER], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT_DIR)}, check=True)
    assert json.loads(done.stdout.removesuffix("after\n")) == {"verdict": "ok"}, done.stdout
    assert all(f"{who} chatter" in done.stderr for who in ("python", "logger", "c", "child")), done.stderr


def test_the_progress_bar_is_tqdms_one_bar_a_phase_and_none_off_a_terminal():
    import io
    from tqdm import tqdm
    from fpemu.cli import output
    stream = io.StringIO()
    bar = output.ProgressBar(tqdm, stream)
    for done, total, label in ((1, 3, "golden a"), (3, 3, "golden c"), (1, 2, "diff x"), (2, 2, "diff y")):
        bar(done, total, label)
    drawn = stream.getvalue()
    assert "3/3" in drawn and "golden c" in drawn and "2/2" in drawn and "diff y" in drawn, drawn


def _golden_stderr(tmp_path, terminal: bool) -> str:
    """What `fpemu golden` of one spec writes to stderr: a pseudo-terminal, or a pipe as in CI."""
    import pty
    command = [sys.executable, "-m", "fpemu", "golden", str(ROOT_DIR / "specs" / "bernoulli_jmp.toml"), "--out",
               str(tmp_path / ("tty" if terminal else "pipe"))]
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
    if not terminal:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=True).stderr
    import fcntl
    import struct
    import termios
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's 100 columns
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower, env=env) as child:
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        assert child.wait(timeout=120) == 0
    os.close(leader)
    return drawn.decode(errors="replace")


def test_a_command_draws_its_progress_on_a_terminal_and_nothing_in_a_pipe(tmp_path):
    assert "1/1" in _golden_stderr(tmp_path, terminal=True)
    assert "1/1" not in _golden_stderr(tmp_path, terminal=False)
