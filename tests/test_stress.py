"""The stress regime's bounded CI slice, and the delay injection it relies on (zerofx/stress.py).

The slice runs ``python -m tests.stress``'s loop (tests/stress.py) for 2 repetitions of one
memory policy (the GPT with its state on disk, the policy the heap corruption of issue 13 was
seen under) and one parity model, with seeded delays at every collective, two busy processes
and a poisoned heap (MALLOC_PERTURB_): every repetition must finish with no crash, no timeout,
no error or failure reported by a rank, and results bit-identical across repetitions.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests import stress as driver
from tests.multirank import run_ranks
from zerofx import stress


def test_parse():
    assert stress.parse(None) is None and stress.parse("") is None
    assert stress.parse("7:5") == (7, 0.005)
    for bad in ("7", "a:5", "7:-1", "1:2:3"):
        with pytest.raises(ValueError, match="ZEROFX_STRESS_DELAY"):
            stress.parse(bad)


def test_off_costs_nothing(monkeypatch):
    monkeypatch.setattr(stress, "CONFIG", None)

    def fn(args):
        return args

    assert stress.wrap_graph(fn) is fn and stress.eager(fn) is fn
    assert stress.collectives() is stress.collectives()  # one shared nullcontext


def test_delays_sit_before_collectives_and_waits(monkeypatch):
    monkeypatch.setattr(stress, "CONFIG", (0, 0.0))
    points = []
    monkeypatch.setattr(stress, "delay", lambda where="": points.append(where))
    _F = torch.ops._c10d_functional
    import torch.distributed as dist

    from tests.multirank import one_rank_mesh

    def graph(args):
        (x,) = args
        y = _F.wait_tensor(_F.all_reduce(x * 2, "sum", dist.group.WORLD.group_name))
        return [y + 1]

    import tempfile

    with tempfile.TemporaryDirectory() as tmp, one_rank_mesh(tmp):
        out = stress.wrap_graph(graph)([torch.ones(3)])
    assert points == ["all_reduce", "wait_tensor"]
    assert torch.equal(out[0], torch.full((3,), 3.0))


def test_judge_reports_errors_failures_and_drift():
    ok = [{"a": {"losses": [1.0], "failures": []}}]
    problems, prints = driver.judge(ok, None)
    assert problems == [] and prints == {"0/a": {"losses": [1.0]}}
    assert driver.judge([{"a": {"losses": [1.5], "failures": []}}], prints)[0]  # drift
    assert driver.judge([{"a": {"failures": ["step 0 grad w: differs"]}}], None)[0]
    assert driver.judge([{"a": {"error": "Traceback\nRuntimeError: boom\n"}}], None)[0] == [
        "rank 0 a: error: RuntimeError: boom"
    ]


def test_ci_slice_under_delays_contention_and_poisoning():
    args = driver.parser().parse_args(
        [
            "--repeat",
            "2",
            "--scenarios",
            "memory",
            "parity",
            "--busy",
            "2",
            "--delay-ms",
            "5",
            "--models",
            "gpt",
            "--memory-policies",
            "budget_100+optimizer_disk",
            "--parity-cases",
            "mlp",
            "--parity-steps",
            "4",
            "--timeout",
            "300",
        ]
    )
    assert isinstance(args, argparse.Namespace)
    lines: list[str] = []
    outcomes = driver.stress(args, log=lines.append)
    assert [o.status for o in outcomes] == ["ok"] * 4, "\n".join(lines)


def test_stage_steps_are_the_stage_tests_own():
    """stages_checks judges the stages with tests/test_zero_stages.py's assertions, which hold at its length."""
    from tests import test_zero_stages

    assert driver.STAGE_STEPS == test_zero_stages.STEPS == driver.parser().parse_args([]).stage_steps


def test_recorded_results_are_judged_by_the_test_files_own_assertions(tmp_path):
    """Before, a stages scenario with no ``failures`` key and no losses (a resumed checkpoint's
    trajectory, a loss scale) was ``ok`` whatever it returned."""
    test_file = tmp_path / "test_recorded.py"
    test_file.write_text(
        "from tests.multirank import replayed\n\n\n"
        "def test_resumed_is_uninterrupted():\n"
        '    r = replayed("case")\n'
        '    assert r["resumed"] == r["uninterrupted"]\n'
    )
    good = driver.check_with_tests(str(test_file), "case", {"resumed": [1.0, 0.9], "uninterrupted": [1.0, 0.9]}, 0, 120)
    bad = driver.check_with_tests(str(test_file), "case", {"resumed": [5.0, 5.0], "uninterrupted": [1.0, 0.9]}, 0, 120)
    assert (good.scenario, good.status) == ("case_checks", "ok"), good.details
    assert bad.status == "mismatch" and any("test_resumed_is_uninterrupted" in d for d in bad.details), bad.details


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_busy_processes_stop_when_the_driver_is_gone():
    """Before, a driver killed without unwinding (SIGKILL, or SIGTERM before it had a handler)
    left its spinners at 100% CPU for good."""
    script = "import os\nfrom tests.stress import Contention\nc = Contention(1).__enter__()\nprint(c.procs[0].pid, flush=True)\nos._exit(0)\n"
    run = subprocess.run([sys.executable, "-c", script], cwd=driver.ROOT, capture_output=True, text=True, timeout=120)
    pid = int(run.stdout.split()[0])
    deadline = time.monotonic() + 20
    while not _exited(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    stopped = _exited(pid)
    if not stopped:
        os.kill(pid, signal.SIGKILL)
    assert stopped, f"spinner {pid} still running after its driver exited"


def test_a_rank_that_exits_without_a_result_fails_the_run_at_once():
    """Before, a rank that left with status 0 and no result was waited for until the timeout."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] sent no result"):
        run_ranks(_leave_quietly_on_rank_1, 2, timeout=120)
    assert time.monotonic() - start < 60


def _leave_quietly_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(0)
    return rank
