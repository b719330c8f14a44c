"""fpemu emulate on model files: the trace and report it writes, and exit 2 naming what is wrong."""

import contextlib
import json
import textwrap

import pytest

torch = pytest.importorskip("torch")

from fpemu.cli import main  # noqa: E402
from fpemu.cli.questions import parse_params  # noqa: E402
from fpemu.emulate.run import emulate_file, write_outputs  # noqa: E402
from fpemu.traces import read_trace  # noqa: E402


pytestmark = pytest.mark.usefixtures("torch_one_thread")


MODEL = '''
import torch

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)

def step(model, optimizer, scaler, index):
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(index))
    optimizer.zero_grad()
    loss = {loss}
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
'''


def _model(tmp_path, loss="model(x).float().square().mean()", name="tiny.py", text=None):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text if text is not None else MODEL.format(loss=loss)))
    return path


STEPS, PARAMS = 3, ["init_scale=2**24", "growth_interval=1"]  # the CLI's run, and the same run through the API


def _emulate(path, out, *extra):
    options = [word for param in PARAMS for word in ("--param", param)]
    return main(["emulate", str(path), "--steps", str(STEPS), *options, "--out", str(out), *extra])


def test_emulate_writes_a_trace_and_a_report_that_compare_reads(tmp_path, capsys):
    path = _model(tmp_path)
    assert _emulate(path, tmp_path / "a", "--json") == 0
    written = json.loads(capsys.readouterr().out)["written"]
    trace = read_trace(next(p for p in written if p.endswith(".json")))
    assert trace.implementation == "emulate_torch@cpu" and trace.metadata["op_table"]["key"] == "AutocastCUDA"
    assert [r["overflow"] for r in trace.steps][:1] == [True]              # 2**24 overflows fp16 at once
    assert "module_underflow" in trace.steps[0] and trace.metadata["telemetry"]["first_nonfinite"]["backward"]
    page = next(p for p in written if p.endswith(".md"))
    assert "## Backward underflow by module" in open(page).read()
    # the same run in this process, through the API, with jax imported here too: byte for byte the child's trace,
    # whose host holds the emulated framework's kernel tiers alone (a torch run's held XLA's tier when JAX was
    # imported), and nothing of the run's time
    with contextlib.suppress(ImportError):
        import jax  # noqa: F401
    in_process = emulate_file(path, steps=STEPS, params=parse_params(PARAMS))
    write_outputs(in_process, tmp_path / "b", plot=False)
    first, second = (next((tmp_path / d).glob("*.json")) for d in "ab")
    assert first.read_bytes() == second.read_bytes()
    assert main(["compare", str(first), str(second)]) == 0


@pytest.mark.stage2("test_emulate_writes_a_trace_and_a_report_that_compare_reads (compare reads an emulated trace); "
                    "test_compare's divergences")
def test_emulations_at_another_scale_compare_as_a_divergence(tmp_path):
    path = _model(tmp_path)
    for scale, out in (("2**24", "a"), ("2**10", "c")):
        assert main(["emulate", str(path), "--steps", "3", "--param", f"init_scale={scale}", "--no-plot",
                     "--out", str(tmp_path / out)]) == 0
    first, other = (next((tmp_path / d).glob("*.json")) for d in "ac")
    assert main(["compare", str(first), str(other)]) == 1


# Each case that runs the file starts a child importing torch (3-5 s): "raises in a module" (the step-error path)
# by default; "no step" and "import error" take the import-error path that test_emulate_isolated's BaseException
# case runs by default, and "unplaceable op" the step-error path (test_emulate_torch places the op).
@pytest.mark.parametrize("case, expected", [
    ("missing", "cannot read: No such file"),
    ("not python", "a model file is a Python file"),
    *[pytest.param(case, expected, marks=pytest.mark.stage2(
        "test_emulate_isolated's test_a_file_raising_base_exception_is_one_line_without_a_traceback"))
      for case, expected in (("no step", "defines no function step()"),
                             ("import error", "importing it raised ZeroDivisionError"))],
    pytest.param("unplaceable op", "cannot place aten::binary_cross_entropy",
                 marks=pytest.mark.stage2("the 'raises in a module' case; test_emulate_torch's unplaceable ops")),
    ("raises in a module", "step 0 raised RuntimeError"),
    ("unknown scaler", "scaler nope: profile: unknown profile 'nope'"),
])
def test_bad_model_files_exit_2_naming_what_is_wrong(tmp_path, capsys, case, expected):
    if case == "missing":
        path = tmp_path / "absent.py"
    elif case == "not python":
        path = _model(tmp_path, name="model.txt")
    elif case == "no step":
        path = _model(tmp_path, text="def build(seed):\n    return None\n")
    elif case == "import error":
        path = _model(tmp_path, text="1 / 0\n")
    elif case == "unplaceable op":
        path = _model(tmp_path, loss="torch.nn.functional.binary_cross_entropy(torch.sigmoid(model(x).float()), "
                                     "torch.zeros(256, 4))")
    elif case == "raises in a module":
        path = _model(tmp_path, loss="model(x[:, :3]).float().mean()")
    else:
        path = _model(tmp_path)
    assert _emulate(path, tmp_path / "out", *(["--scaler", "nope"] if case == "unknown scaler" else [])) == 2
    error = capsys.readouterr().err
    assert expected in error and (case in ("missing", "unknown scaler") or path.name in error), error
    if case == "raises in a module":
        assert "(in module 0)" in error
