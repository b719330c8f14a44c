"""`fpemu simulate --vs` shows two profiles side by side; `--save` writes traces that `fpemu compare` reads."""

import json

import fpemu
from fpemu.cli import main
from fpemu.traces import read_trace


def cli(capsys, *argv):
    code = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_two_profiles_side_by_side(capsys):
    code, out, _ = cli(capsys, "simulate", "--overflow-steps", "2", "--steps", "4", "--param", "init_scale=1024",
                       "--vs", "keras", "--vs-param", "initial_scale=1024", "--vs-param", "dynamic_growth_steps=1")
    torch = fpemu.simulate_scaler([s == 2 for s in range(4)], "torch", init_scale=1024.0)
    keras = fpemu.simulate_scaler([s == 2 for s in range(4)], "keras", initial_scale=1024.0, dynamic_growth_steps=1)
    lines = out.splitlines()
    assert code == 0 and "profile torch: torch.amp.GradScaler (driven)" in lines
    assert "params: initial_scale=1024, dynamic_growth_steps=1" in lines
    header = next(line for line in lines if line.lstrip().startswith("step"))
    assert header.split() == ["step", "overflow", "torch", "scale", "update", "counter", "keras", "scale", "update",
                              "counter"]
    rows = [line.split() for line in lines if " applied " in line or " skipped " in line]
    cells = [[c for c in row if c != "X"] for row in rows]
    assert [float(r[1]) for r in cells] == torch.scales and [float(r[4]) for r in cells] == keras.scales
    assert [r[-1] == "differ" for r in cells] == [a != b for a, b in zip(torch.scales, keras.scales)] == [
        False, True, True, True]
    assert f"keras: 4 steps: 3 updates applied, 1 skipped; final scale {keras.final_scale:.9g}" in out


def test_json_holds_both_profiles_and_vs_param_needs_vs(capsys):
    code, out, _ = cli(capsys, "simulate", "--overflow-steps", "1", "--vs", "flax", "--json")
    result = json.loads(out)
    assert code == 0 and (result["profile"], result["vs"]["profile"]) == ("torch", "flax")
    assert [s["scale"] for s in result["vs"]["steps"]] == fpemu.simulate_scaler([False, True], "flax").scales
    for argv, words in ((["--vs-param", "x=1"], "--vs-param: sets the parameters of the --vs profile"),
                        (["--vs", "pytorch"], "--vs pytorch: unknown profile"),
                        (["--vs", "keras", "--vs-param", "init_scale=2"], "--vs-param (--vs keras): ")):
        code, _, err = cli(capsys, "simulate", "--overflow-steps", "1", *argv)
        assert code == 2 and words in err, (argv, err)


def test_saved_traces_compare(tmp_path, capsys):
    code, out, _ = cli(capsys, "simulate", "--overflow-steps", "1", "--steps", "3", "--param", "init_scale=8",
                       "--vs", "keras", "--save", tmp_path)
    torch_file, keras_file = tmp_path / "simulate_torch.json", tmp_path / "simulate_keras.json"
    assert code == 0 and f"wrote {torch_file} (a trace: `fpemu compare` reads it)" in out
    trace = read_trace(torch_file)
    assert [s["scale"] for s in trace.steps] == [8.0, 8.0, 4.0] and trace.metadata["profile"] == "torch"
    code, out, _ = cli(capsys, "compare", torch_file, keras_file)
    first = next(line for line in out.splitlines() if line.startswith("first divergence:"))
    assert code == 1 and "[profiles differ: torch -> keras]" in out
    assert first == ("first divergence: step 0, scale: before 8.0 (0x1.0000000000000p+3), after 32768.0 "
                     "(0x1.0000000000000p+15) (likely cause: the initial scale differs (8.0 -> 32768.0): the scalers "
                     "start at another init_scale (or another profile's default))")
    assert cli(capsys, "compare", torch_file, torch_file)[0] == 0
