"""The stress regime's bounded CI slice, and the delay injection it relies on (zerofx/stress.py).

The slice runs ``python -m tests.stress``'s loop (tests/stress.py) for 2 repetitions of one
memory policy (the GPT with its state on disk, the policy the heap corruption of issue 13 was
seen under) and one parity model, with seeded delays at every collective, two busy processes
and a poisoned heap (MALLOC_PERTURB_): every repetition must finish with no crash, no timeout,
no error or failure reported by a rank, and results bit-identical across repetitions.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests import stress as driver
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
