"""fpemu emulate on JAX model files: the trace (a golden `fpemu compare` reads), the report page, the
framework chosen by the file's FRAMEWORK, and exit 2 naming the file, function or primitive.
FPEMU_TEST_EXAMPLES=1 also reruns examples/flax_emulate.py against its committed trace."""

import contextlib
import json
import os
import pathlib
import textwrap

import pytest

pytest.importorskip("jax")

from fpemu.cli import main  # noqa: E402
from fpemu.cli.questions import parse_params  # noqa: E402
from fpemu.emulate.run import emulate_file, write_outputs  # noqa: E402
from fpemu.traces import read_trace  # noqa: E402
from fpemu.traces.format import behaviour  # noqa: E402

MODEL = '''
import jax
import jax.numpy as jnp

FRAMEWORK = "jax"
X = jax.random.normal(jax.random.PRNGKey(1), (16, 8)) * 3

def build(seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": jax.random.normal(k1, (8, 16)) * 0.5, "w2": jax.random.normal(k2, (16, 4)) * 0.5}

def _loss(p):
    h = jnp.tanh(X.astype(jnp.float16) @ p["w1"].astype(jnp.float16))
    return {loss}

def grads(state, scale, index):
    loss, g = jax.value_and_grad(lambda p: _loss(p) * scale)(state)
    return loss / scale, g

def update(state, g, index):
    return jax.tree_util.tree_map(lambda p, d: p - 0.01 * d, state, g)
'''
LOSS = 'jnp.square((h @ p["w2"].astype(jnp.float16)).astype(jnp.float32)).mean()'


def _model(tmp_path, text=None, loss=LOSS, name="tiny_jax.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text if text is not None else MODEL.replace("{loss}", loss)))
    return path


STEPS, PARAMS = 2, ["scale=2**20", "growth_interval=1"]  # the CLI's run, and the same run through the API


def _emulate(path, out, *extra):
    options = [word for param in PARAMS for word in ("--param", param)]
    return main(["emulate", str(path), "--steps", str(STEPS), *options, "--out", str(out), *extra])


def test_jax_file_gives_a_golden_trace_and_a_report(tmp_path, capsys):
    path = _model(tmp_path)
    assert _emulate(path, tmp_path / "a", "--json", "--no-plot") == 0
    written = json.loads(capsys.readouterr().out)["written"]
    trace = read_trace(next(p for p in written if p.endswith(".json")))
    assert trace.implementation == "emulate_jax@cpu" and trace.metadata["profile"] == "flax"
    assert trace.metadata["op_table"]["semantics"]["name"] == "jax_cpu_strict"
    assert [r["overflow"] for r in trace.steps][0]                             # 2**20 overflows fp16's backward
    assert trace.steps[1]["scale"] < trace.steps[0]["scale"]
    assert trace.metadata["telemetry"]["first_nonfinite"]["backward"]["produced"] == "overflow"
    assert "<root>" in trace.steps[-1]["module_underflow"]                  # no modules here: the loss is the root
    page = open(next(p for p in written if p.endswith(".md"))).read()
    assert "Primitive table: jax" in page and "compute the program's own dtypes" in page
    # the same run in this process, through the API, with torch imported here too: byte for byte the child's trace,
    # whose host holds the emulated framework's kernel tiers alone (a JAX run's held torch's tiers when torch was
    # imported), and nothing of the run's time
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401
    in_process = emulate_file(path, steps=STEPS, params=parse_params(PARAMS))
    write_outputs(in_process, tmp_path / "b", plot=False)
    first, second = (next((tmp_path / d).glob("*.json")) for d in "ab")
    assert first.read_bytes() == second.read_bytes()
    assert main(["compare", str(first), str(second)]) == 0


# Each case starts a child importing JAX and the file (about 5 s): one by default; the import-time check of
# the file's functions, the policy's framework and a step's unplaceable primitive in stage 2.
BAD_JAX_FILES = [
    ("other.py", "FRAMEWORK = 'mxnet'\ndef build(seed): pass\n", (), ["FRAMEWORK = 'mxnet'"]),
    pytest.param("no_update.py", MODEL.replace("def update", "def apply"), (),
                 ["no_update.py: defines no function update()"], marks=pytest.mark.stage2("the 'other.py' case")),
    pytest.param("tiny_jax.py", None, ("--policy", "cuda_autocast_fp16"), ["placement autocast is not one jax emulates"],
                 marks=pytest.mark.stage2("the 'other.py' case; test_emulate_jax's policy refusals")),
    pytest.param("mystery.py", MODEL.replace("{loss}", 'jnp.linalg.det(h[:4, :4].astype(jnp.float32))'), (),
                 ["mystery.py: step 0", "cannot place primitive"],
                 marks=pytest.mark.stage2("test_emulate_jax's test_refusals_name_what_is_wrong (an unplaceable "
                                          "primitive); the 'other.py' case (exit 2 from the file's child)")),
]


@pytest.mark.parametrize("name, text, options, words", BAD_JAX_FILES)
def test_bad_jax_files_exit_2_naming_what_is_wrong(tmp_path, capsys, name, text, options, words):
    assert _emulate(_model(tmp_path, text=text, name=name), tmp_path / "o", *options) == 2
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


@pytest.mark.skipif(os.environ.get("FPEMU_TEST_EXAMPLES") != "1", reason="minutes: set FPEMU_TEST_EXAMPLES=1")
def test_flax_example_reproduces_its_committed_trace(tmp_path):
    pytest.importorskip("flax")
    root = pathlib.Path(__file__).resolve().parent.parent
    assert main(["emulate", str(root / "examples" / "flax_emulate.py"), "--steps", "24", "--scaler", "flax",
                 "--param", "scale=1048576", "--param", "growth_interval=4", "--no-plot",
                 "--out", str(tmp_path)]) == 0
    name = "flax_emulate.program.emulate_jax-cpu.json"
    obtained, committed = read_trace(tmp_path / name), read_trace(root / "reports" / "emulate" / name)
    made_on, here = (trace.metadata["host"]["cpu_features"] for trace in (committed, obtained))
    if made_on != here:
        # XLA computes the float32 dots and convolutions; its runtime kernels (oneDNN's sgemm among them) are
        # the CPU's: an AVX2 Zen 3 and this file's AVX-512 host differ in 4 telemetry counts of 24 steps.
        pytest.skip(f"the committed trace holds XLA:CPU's float32 arithmetic on a CPU with {', '.join(made_on)}; "
                    f"this one has {', '.join(here)}")
    assert behaviour(obtained) == behaviour(committed)  # versions are provenance
