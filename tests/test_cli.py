import subprocess
import sys

from fpemu.cli import main


def test_run_writes_reports(tmp_path, capsys):
    assert main(["run", "--reports", str(tmp_path)]) == 0
    text = (tmp_path / "formats.md").read_text()
    assert "| fp8_e4m3fn | 1-4-3 | 7 | fn | 448 |" in text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_console_script_usage_error_exits_2():
    proc = subprocess.run([sys.executable, "-m", "fpemu.cli", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_help_on_every_command():
    for command in (["--help"], ["run", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "fpemu.cli", *command], capture_output=True, text=True)
        assert proc.returncode == 0 and "usage: fpemu" in proc.stdout
