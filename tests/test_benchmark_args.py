"""The benchmark scripts refuse bad arguments at parse time (a usage error naming the argument,
exit status 2, before any rank starts) instead of failing inside a rank or printing an empty
table; and benchmarks/peers.py reports methods that all failed to set up as error rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_CACHE_SWITCH = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"
_CACHE_SWITCH_BEFORE = os.environ.get(_CACHE_SWITCH)  # at collection, before any test imports compile_time


@pytest.mark.parametrize(
    "script, args, says",
    [
        ("gpu_check.py", ["--sections", "parity_w1,bogus"], ["--sections", "bogus", "parity_w1", "codegen"]),
        ("peers.py", ["--steps", "0"], ["--steps", "positive"]),
        ("peers.py", ["--from-json", "/no/such/rows.json"], ["--from-json", "/no/such/rows.json"]),
        ("step_breakdown.py", ["--methods", "ddp", "bogus"], ["--methods", "bogus", "zerofx_tuned"]),
        ("plan_accuracy.py", ["--only", "nosuch"], ["--only", "nosuch", "hf-llama"]),
        ("gpu_check.py", ["--budget-s", "-5"], ["--budget-s", "at least 15 s"]),
        ("generate.py", ["--repeats", "0"], ["--repeats", "positive"]),
        ("generate.py", ["--world-sizes", "0"], ["--world-sizes", "positive"]),
        ("collectives.py", ["--repeats", "0"], ["--repeats", "positive"]),
        ("async_overlap.py", ["--repeats", "0"], ["--repeats", "positive"]),
        ("shapes.py", ["--world-size", "0"], ["--world-size", "positive"]),
        ("export_memory.py", ["--tensor-mib", "0"], ["--tensor-mib", "positive"]),
    ],
)
def test_a_script_refuses_a_bad_argument(script, args, says):
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert all(s in run.stderr for s in says), run.stderr


@pytest.mark.parametrize(
    "module, args, option",
    [
        ("peers", ["--world-sizes", "2", "0"], "--world-sizes"),
        ("peers", ["--launches", "0"], "--launches"),
        ("peers", ["--batch", "0"], "--batch"),
        ("shapes", ["--rounds", "0"], "--rounds"),
        ("zeropp", ["--steps", "0"], "--steps"),
        ("compile_time", ["--world", "0"], "--world"),
        ("compile_time", ["--rounds", "-1"], "--rounds"),
        ("step_breakdown", ["--profile-steps", "0"], "--profile-steps"),
        ("step_breakdown", ["--steps", "0"], "--steps"),
        ("step_breakdown", ["--methods", "deepspeed"], "--methods"),
    ],
)
def test_a_count_below_one_is_a_usage_error(module, args, option, capsys, monkeypatch):
    import importlib

    # compile_time.py turns Inductor's caches off for its process at import (an environment
    # variable): undone after the test, or every later test's ranks here would inherit it
    # (setenv records the variable's state before, absent included; delenv of an absent one
    # records nothing to restore)
    monkeypatch.setenv(_CACHE_SWITCH, "0")
    script = importlib.import_module(f"benchmarks.{module}")

    def started(*_, **__):
        raise AssertionError("the benchmark started: the argument was not refused at parse time")

    for name in ("launch_local", "run"):  # so that a regression fails here, fast, instead of measuring
        if hasattr(script, name):
            monkeypatch.setattr(script, name, started)
    with pytest.raises(SystemExit) as exit_:
        script.main(args)
    assert exit_.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err


def test_round_robin_with_no_methods_left_times_nothing():
    from benchmarks.peers import time_round_robin

    time_round_robin({}, 3)  # every method failed to set up: no ZeroDivisionError


def test_methods_that_all_fail_to_set_up_are_error_rows():
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.peers import Setup, measure_methods

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        setup = Setup("tiny", 1, 2, 2, ("zerofx:bogus=1",))
        out = measure_methods(setup, 0, 1, mesh)
    finally:
        dist.destroy_process_group()
    assert list(out) == ["zerofx:bogus=1"]
    assert "bogus" in out["zerofx:bogus=1"]["error"], out


def _launch_rows(fsdp2_s: float, zerofx: dict) -> list[dict]:
    def result(step_s: float) -> dict:
        return {"step_s": step_s, "compile_s": 1.0, "peak_bytes": 1, "state_bytes": 1, "comm_bytes": 1}

    return [{"fsdp2": result(fsdp2_s), "zerofx": zerofx if "error" in zerofx else result(zerofx["step_s"])}] * 2


def test_peers_rows_over_launches_say_a_failed_launch_and_rate_the_single_row_by_the_fsdp2_row_shown():
    """A method that failed in a later launch was reported from the first launch alone (no range,
    nothing said), and the single-process row's ratio was to the first launch's FSDP2, not the
    median FSDP2 printed beside it."""
    from benchmarks.peers import combine

    launches = [
        _launch_rows(0.100, {"step_s": 0.070}),
        _launch_rows(0.200, {"error": "Traceback ...\nRuntimeError: boom"}),
        _launch_rows(0.300, {"step_s": 0.290}),
    ]
    single = {"step_s": 0.150, "compile_s": 0.0, "peak_bytes": 1, "state_bytes": 1, "comm_bytes": 0, "batch": 8}
    rows = {r["method"].split(" ")[0]: r for r in combine("tiny", 2, launches, single)}
    assert rows["fsdp2"]["step_s"] == 0.200
    assert rows["single"]["ratio_to_fsdp2"] == 0.150 / 0.200
    assert "error" in rows["zerofx"] and "launch(es) [2] of 3" in rows["zerofx"]["error"], rows["zerofx"]


def test_importing_compile_time_leaves_no_cache_switch_behind():
    """Runs after the parametrized tests above in the same process (pytest keeps a file's
    order): the variable compile_time.py sets at import is as it was before (it made every
    later test's ranks warn that Inductor's caches were off)."""
    assert os.environ.get(_CACHE_SWITCH) == _CACHE_SWITCH_BEFORE
