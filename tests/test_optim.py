"""Optimizer steps on local shards (zerofx/runtime/local_step.py) on 2 gloo ranks: bit-for-bit the same
parameters and state as stepping the DTensors, for the optimizers that take the local path,
the stage-2 refresh after it, LR schedulers around it, the DTensor path kept for a subclass,
and a step that raises."""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks, scenario_results
from tests.optim_scenarios import OPTIMIZERS, STEPS, scenarios

WORLD = 2


@pytest.fixture(scope="module")
def results():
    return run_ranks(scenarios, WORLD)


@pytest.mark.parametrize("name", [*OPTIMIZERS, "stage2_adamw", "lr_schedulers"])
def test_local_step_matches_the_dtensor_step_bit_for_bit(results, name):
    for r in scenario_results(results, name):
        assert r["steps_locally"] == (False, True)
        # the first step runs on DTensors (it is when the optimizer is adopted), the rest locally
        assert r["seen_dtensor_path"] == [{"DTensor"}] * STEPS
        assert r["seen_local_path"] == [{"DTensor"}] + [{"Tensor"}] * (STEPS - 1)
        assert r["params_equal"] and r["state_equal"]
        assert "DTensor" in r["state_kinds"]  # state stays DTensors between steps
        a, b = r["losses"]
        assert a == b  # stage 2's last loss reads the whole copies refreshed after a local step
        assert r["lrs"][0] == r["lrs"][1]
        assert r["scheduler_warnings"] == []


def test_lr_schedulers_wrap_the_local_step(results):
    # one built before the first step, one after zerofx adopted the optimizer: both see the steps
    for r in scenario_results(results, "lr_schedulers"):
        assert r["lrs"][1] == pytest.approx(1e-2 * 0.9**STEPS * 0.5 ** (STEPS - 1))


def test_optimizer_subclass_keeps_the_dtensor_path(results):
    for r in scenario_results(results, "subclass"):
        assert r["steps_locally"] == (False, False)
        assert r["seen_local_path"] == [{"DTensor"}] * STEPS
        assert r["params_equal"] and r["state_equal"]


def test_a_step_that_raises_leaves_the_dtensors_in_place(results):
    for r in scenario_results(results, "failing_step"):
        assert r["raised"] == "boom"
        assert r["params_back"]
        assert r["state_kinds"] == ["DTensor", "Tensor"]  # moments as DTensors, "step" a plain scalar
        assert not r["grads_on_locals"]
        assert r["loss"] == r["ref_loss"]
