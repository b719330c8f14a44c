"""docs/questions.md: every command runs as written (from the checkout's root) and prints the lines the
page shows ("..." stands for output left out, within a line or as lines of its own)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "questions.md"
QUESTIONS = ("What scales will my GradScaler produce?", "How much of my gradients underflows?", "Record my run",
             "Compare two runs", "Emulate my model", "Audit an upgrade")
EXIT_CODES = {"Compare two runs": 1}  # the two runs differ; every other command succeeds
SHELL = 'python() { "$FPEMU_PYTHON" "$@"; }; fpemu() { "$FPEMU_PYTHON" -m fpemu "$@"; }; '


def sections(text: str) -> list:
    """(question, command, shown output lines) per '## ' section: its bash block and the text block after."""
    out = []
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        question = part.splitlines()[0].strip()
        command = re.search(r"```bash\n(.*?)```", part, re.S)
        shown = re.search(r"```bash\n.*?```\s*```text\n(.*?)```", part, re.S)
        out.append((question, command and command.group(1).strip(), shown and shown.group(1).splitlines()))
    return out


def printed(line: str, output: list) -> bool:
    """Whether a shown line is among the printed ones ('...' inside it: its pieces in order on one line)."""
    pieces = [piece for piece in line.rstrip().split("...")]
    if len(pieces) == 1:
        return line.rstrip() in output
    pattern = ".*".join(re.escape(piece) for piece in pieces)
    return any(re.fullmatch(pattern, printed_line) for printed_line in output)


def test_matching_of_shown_lines():
    output = ["numerics only: loss at 7 of 8 steps (max 3999436 ulp), scale identical", "a  b"]
    assert printed("numerics only: loss at 7 of 8 steps (max ... ulp), scale identical", output)
    assert not printed("numerics only: loss at 6 of 8 steps (max ... ulp), scale identical", output)
    assert printed("a  b", output) and not printed("a b", output)


def test_every_question_has_a_command_and_its_output():
    found = sections(PAGE.read_text())
    assert [question for question, _, _ in found] == list(QUESTIONS)
    assert all(command and shown for _, command, shown in found)


@pytest.mark.stage2("runs six commands, torch imported in each (about 100 s); the page's sections in the test "
                    "above")
def test_each_command_runs_as_written_and_prints_what_the_page_shows():
    shutil.rmtree(ROOT / "reports" / "local" / "questions", ignore_errors=True)
    (ROOT / "reports" / "local" / "questions").mkdir(parents=True)
    env = {**os.environ, "FPEMU_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    problems, seconds = [], {}
    for question, command, shown in sections(PAGE.read_text()):  # in page order: compare reads what record wrote
        start = time.perf_counter()
        done = subprocess.run(["bash", "-c", SHELL + command], cwd=ROOT, env=env, capture_output=True, text=True)
        seconds[question] = round(time.perf_counter() - start, 1)
        output = done.stdout.splitlines()
        if done.returncode != EXIT_CODES.get(question, 0):
            problems.append(f"{question}: exit {done.returncode}\n{done.stderr[-2000:]}")
        missing = [line for line in shown if line.strip() not in ("", "...") and not printed(line, output)]
        if missing:
            problems.append(f"{question}: not printed: {missing}\nprinted:\n{done.stdout}")
    assert not problems, "\n\n".join(problems) + f"\n(seconds: {seconds})"


def test_the_readme_asks_the_same_questions_with_the_commands_and_lines_this_page_runs():
    """The README's short answers are this page's (whose commands the test above runs): each README command is
    one of the page's, and each output line it shows is a line the page shows for that command."""
    page = {command: shown for _, command, shown in sections(PAGE.read_text())}
    readme = (ROOT / "README.md").read_text().split("## One command per question", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n\$ (.*?)\n(.*?)```", readme, re.S)
    assert len(blocks) == len(QUESTIONS)
    for command, output in blocks:
        assert command in page, f"README command not in docs/questions.md: {command}"
        for line in output.splitlines():
            assert line in page[command], f"README line not shown by docs/questions.md for {command!r}: {line}"
