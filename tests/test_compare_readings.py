"""`fpemu compare` on two recordings of one torch loop, with and without clipping before unscale_: a short
first-divergence line that summarizes the grad_stats dict and names the clipping as the likely cause."""

import pytest

from fpemu.cli import main
from fpemu.compare import trace_changes
from fpemu.compare.readings import summarize_dicts

LINE_LIMIT = 480  # the line printed ~3,000 characters of grad_stats before


def record_loop(path, clip_first: bool):
    import torch
    from fpemu.recorders.torch_run import record_torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with record_torch(scaler, optimizer, model, path=path, name="loop") as rec:
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if not clip_first:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    return rec


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loops")
    good, bad = folder / "good.json", folder / "bad.json"
    assert not record_loop(good, clip_first=False).audit.findings
    assert {f.kind for f in record_loop(bad, clip_first=True).audit.findings} == {"clip_before_unscale"}
    return good, bad


@pytest.mark.fpemu_torch
@pytest.mark.parametrize("order", ["good_first", "bad_first"])
def test_first_divergence_line_is_short_and_names_clipping(recordings, capsys, order):
    before, after = recordings if order == "good_first" else recordings[::-1]
    assert main(["compare", str(before), str(after)]) == 1
    line = next(text for text in capsys.readouterr().out.splitlines() if text.startswith("first divergence:"))
    assert len(line) < LINE_LIMIT, line
    # the recorder measures each backward's own gradients, before the loop clips them: step 0's agree, and
    # the first difference is step 1's, after step 0's differently clipped update
    assert line.startswith("first divergence: step 1, grad_stats: 2 of 2 keys differ (0, 2) in max_abs"), line
    assert "_hex" not in line and "'elements'" not in line and "different arithmetic" not in line
    run = "second run" if order == "good_first" else "first run"
    assert f"the recorded audits differ: clip_before_unscale ({run} 3x from step 0)" in line, line


@pytest.mark.fpemu_torch
def test_later_loss_blames_the_previous_update(recordings):
    from fpemu.compare.readings import recorded_cause
    from fpemu.traces import read_trace
    good, bad = map(read_trace, recordings)
    assert trace_changes(good, bad).field("loss").steps[0] == 1
    assert recorded_cause("loss", 1, good, bad).startswith("the loss differs from step 1 on: the update at step 0")


def test_summarize_dicts_names_keys_and_the_largest_change():
    a = {"fc": {"max_abs": 8.0, "max_abs_hex": (8.0).hex(), "zero": 0.0}, "out": {"max_abs": 2.0, "zero": 0.0}}
    b = {"fc": {"max_abs": 1.0, "max_abs_hex": (1.0).hex(), "zero": 0.0}, "out": {"max_abs": 2.0, "zero": 0.5}}
    assert summarize_dicts(a, b) == "2 of 2 keys differ (fc, out) in max_abs, zero; largest: fc.max_abs 8.0 -> 1.0 (x0.125)"
    assert summarize_dicts(a, {"fc": a["fc"]}) == "keys only before: out; only after: none"
    many = {f"g{i}": {"n": i} for i in range(6)}
    assert summarize_dicts(many, {k: {"n": -1} for k in many}).startswith("6 of 6 keys differ (g0, g1, g2, ... (3 more)) in n")
