"""Plain graph inputs (zerofx/runtime/params.py, NOTE: plain graph inputs) on 2 gloo ranks: the
compiled frames are given plain local tensors instead of DTensor parameters, and training is
bit-for-bit what it is with DTensor inputs (``plain_graph_inputs=False``): every stage,
gradient accumulation with in-place zeroing, a parameter frozen after sharding, and user
hooks on a parameter (``register_hook`` changing its gradient, a post-accumulate hook)."""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks, scenario_results
from tests.plain_inputs_scenarios import scenarios

WORLD = 2


@pytest.fixture(scope="module")
def results():
    return run_ranks(scenarios, WORLD, timeout=600)


@pytest.mark.parametrize("name", ["stage3", "stage2", "stage1", "hooks", "accumulation"])
def test_plain_graph_inputs_train_bit_for_bit_like_dtensor_inputs(results, name):
    for r in scenario_results(results, name):
        off, on = r["input_kinds"]
        assert "DTensor" in off
        assert "DTensor" not in on and "Tensor" in on
        a, b = r["losses"]
        assert a == b
        assert r["params_equal"] and r["grads_equal"]
        assert r["grad_kinds"] == (["DTensor"], ["DTensor"])
        assert r["frozen_grad_none"] == (True, True)


def test_parameter_hooks_fire_as_on_dtensor_inputs(results):
    for r in scenario_results(results, "hooks"):
        off, on = r["hook_calls"]
        assert off == on == ["DTensor"] * 3


def test_a_frame_shared_by_modules_of_other_rows_runs_each_with_its_own(results):
    """zerofx.compile's guard filter drops per-parameter guards only on what every parameter
    shares: a frame of one Linear class run for a 5-row and a 6-row head (the same 3 local rows
    on rank 0) recompiles for the second, and both train as the unsharded model does."""
    for r in scenario_results(results, "frame_shared_by_modules"):
        got, want = r["loss"]
        assert got == pytest.approx(want, rel=1e-6)
        assert r["grads_err"] <= 1e-6
