"""``zerofx demo`` as a new user runs it: the progress bar, the plots, and no warnings."""

from __future__ import annotations

import json

import pytest

from zerofx.cli import main
from zerofx.demo import ProgressLine

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def spawned_ranks(monkeypatch):
    """These tests read what the demo's ranks print: ranks spawned by the demo inherit this
    test's captured stdout, while ranks forked from the suite's fork server (tests/conftest.py)
    write to the server's."""
    import zerofx.launch

    monkeypatch.setattr(zerofx.launch, "START_METHOD", "spawn")


def test_demo_draws_a_progress_bar_and_writes_the_plots(tmp_path, capfd):
    assert main(["demo", "--steps", "3", "--progress", "bar", "--plot", str(tmp_path / "plots")]) == 0
    out, err = capfd.readouterr()
    assert "[####################] 3/3 ETA 0s loss" in out
    assert "loss " in out and " -> " in out  # the bar's summary line
    assert "warning" not in (out + err).lower(), out + err
    for name in ("loss.png", "memory.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    numbers = json.loads((tmp_path / "plots" / "demo.json").read_text())
    assert len(numbers["loss"]) == len(numbers["measured_peak"]) == 3
    assert numbers["estimated_peak"] > 0 and all(b > 0 for b in numbers["measured_peak"])
    assert f"{numbers['loss'][0]:.4f} -> {numbers['loss'][-1]:.4f}" in out


def test_demo_prints_a_line_per_step_when_not_on_a_terminal(capfd):
    assert main(["demo", "--steps", "2", "--progress", "lines", "--layers", "1"]) == 0
    out, err = capfd.readouterr()
    assert "   1/2 " in out and "   2/2 " in out and "[#" not in out
    assert "warning" not in (out + err).lower(), out + err


def test_demo_plan_prints_the_prediction_then_the_measurement_beside_it(capfd):
    import re

    assert main(["demo", "--plan", "--steps", "2", "--progress", "lines", "--layers", "1"]) == 0
    out, err = capfd.readouterr()
    assert out.index("zerofx plan:") < out.index("   1/2 ")  # planned before training
    line = re.search(r"plan vs measured \(rank 0\): model state (\S+) MiB / (\S+) MiB; "
                     r"collective bytes per step (\S+) MiB / (\S+) MiB", out)  # fmt: skip
    assert line, out
    assert line.group(1) == line.group(2) and line.group(3) == line.group(4)  # exact, as the benchmark shows
    assert "warning" not in (out + err).lower(), out + err


def test_progress_line_redraws_in_place_and_ignores_the_first_step_for_the_eta(monkeypatch):
    import io

    clock = iter([0.0, 10.0, 11.0, 12.0])  # __init__ (unused), step 1 (compiles), steps 2 and 3
    monkeypatch.setattr("zerofx.demo.time.perf_counter", lambda: next(clock))
    stream = io.StringIO()
    bar = ProgressLine(4, stream)
    next(clock)
    bar.update(1, "a")
    bar.update(2, "b")
    bar.update(3, "c")
    bar.close()
    lines = stream.getvalue().split("\r")[1:]
    assert lines[0].startswith("[#####...............] 1/4 ETA 0s a")
    assert lines[1].startswith("[##########..........] 2/4 ETA 2s b")  # 1 s per step since step 1
    assert lines[2].startswith("[###############.....] 3/4 ETA 1s c")
    assert stream.getvalue().endswith("\n")


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r"pip install 'zerofx\[plots\]'"):
        main(["demo", "--plot", "somewhere"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "--batch 0: each of --world-size, --steps, --batch, --seq-len, --layers, --d-model"),
        (["--batch", "-1"], "--batch -1: each of"),
        (["--seq-len", "0"], "--seq-len 0: each of"),
        (["--layers", "0"], "--layers 0: each of"),
        (["--d-model", "0"], "--d-model 0: each of"),
        (["--steps", "0", "--world-size", "0"], "--world-size 0, --steps 0: each of"),
        (["--d-model", "7"], "--d-model 7: the demo's GPT splits it over 4 attention heads, so give a multiple of 4"),
    ],
)
def test_bad_sizes_are_argument_errors_before_any_rank_starts(args, message, capsys, monkeypatch):
    import zerofx.cli

    monkeypatch.setattr(zerofx.cli, "run_demo", lambda cfg: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as info:
        main(["demo", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
