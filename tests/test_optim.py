"""Optimizer steps on local shards (zerofx/runtime/local_step.py) on 2 gloo ranks: bit-for-bit the same
parameters and state as stepping the DTensors, for the optimizers that take the local path,
the stage-2 refresh after it, LR schedulers around it, the DTensor path kept for a subclass,
and a step that raises. Optimizers stepped over whole tensors (zerofx/runtime/whole_step.py:
Adafactor, transformers' Adafactor, Muon) and Rprop against the same optimizer stepping an
unsharded model on the same gradients, bit for bit, through a closure, a pre-hook and a
checkpoint resume."""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks, scenario_results
from tests.optim_scenarios import OPTIMIZERS, STEPS, WHOLE, hybrid_scenarios, scenarios

WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(scenarios, WORLD, str(tmp_path_factory.mktemp("optim")))


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


def _assert_matches_the_unsharded_step(r: dict) -> None:
    assert r["moved"]
    assert r["mismatched_params"] == [[]] * STEPS
    assert r["mismatched_state"] == [[]] * STEPS
    a, b = r["last_losses"]
    assert a == b  # the next forward reads the stepped parameters (stage 2: its refreshed whole copies)


@pytest.mark.parametrize(
    "name", [*WHOLE, "adafactor_stage2", "muon_uneven", "adafactor_alone", "hf_adafactor_alone", "muon_alone"]
)
def test_whole_tensor_steps_match_the_unsharded_step_bit_for_bit(results, name):
    for r in scenario_results(results, f"whole_{name}"):
        _assert_matches_the_unsharded_step(r)
        assert r["closure_losses"] and all(r["closure_losses"])  # step(closure) returns the closure's loss
        # the user's pre-hook, registered after zerofx adopted the optimizer, still ran before the step
        assert r["hook_saw_changed"] == [False] * (STEPS - 1)


def test_whole_tensor_step_state_is_sharded_where_shaped_like_the_parameter(results):
    # (state key, parameter dims, kind): Muon's momentum and Adafactor's unfactored variance of a
    # 1-D parameter are shaped like it: DTensors, 1/N per rank; Adafactor's row and column
    # factors of a matrix and the step counts are whole on every rank, plain tensors
    for r in scenario_results(results, "whole_muon"):
        assert r["state_layout"] == [("momentum_buffer", 2, "DTensor")]
    for r in scenario_results(results, "whole_adafactor"):
        assert r["state_layout"] == [
            ("col_var", 2, "Tensor"),
            ("row_var", 2, "Tensor"),
            ("step", 1, "Tensor"),
            ("step", 2, "Tensor"),
            ("variance", 1, "DTensor"),
        ]


@pytest.mark.parametrize("name", ["adafactor", "hf_adafactor", "muon"])
def test_whole_tensor_steps_with_state_on_disk_match_the_unsharded_step(results, name):
    """``zerofx.offload_optimizer`` over a model whose state is on disk: the whole-tensor step runs
    in windows of 16 KiB (several per step), bit for bit the unsharded step; afterwards every
    parameter shard and every state tensor shaped like its parameter is in a memory-mapped file,
    and only the small state every rank holds whole (Adafactor's factors, step counts) is not."""
    for r in scenario_results(results, f"whole_{name}_offload"):
        _assert_matches_the_unsharded_step(r)
        assert len(r["windows_run"]) == STEPS and min(r["windows_run"]) > 1, r["windows_run"]
        assert r["params_placed"] == [True]
        sharded = {(k, placed) for k, kind, placed in r["placed"] if kind == "DTensor"}
        assert sharded and all(placed for _, placed in sharded), r["placed"]
        assert all(not placed for _, kind, placed in r["placed"] if kind != "DTensor"), r["placed"]


@pytest.mark.parametrize("name", ["hf_adafactor", "muon"])
def test_whole_tensor_step_resumes_from_a_checkpoint(results, name):
    for r in scenario_results(results, f"whole_{name}_resume"):
        assert r["resumed"] == []  # the same last step from the checkpoint: the same parameters
        assert r["mismatched_params"] == [[]] * STEPS


@pytest.fixture(scope="module")
def hybrid_results():
    return run_ranks(hybrid_scenarios, 4)


@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_whole_tensor_steps_on_a_hybrid_mesh_match_the_unsharded_step(hybrid_results, name):
    for r in scenario_results(hybrid_results, f"whole_{name}"):
        _assert_matches_the_unsharded_step(r)


def test_lbfgs_at_stage_2_steps_like_stage_3(results):
    """LBFGS evaluates its closure between updates of the parameters, through DTensor: at stage
    2 each evaluation reads whole copies refreshed from the shards the step just changed (without
    the refresh zerofx's stale-copy check stops the forward), so it takes the same steps as at
    stage 3, which gathers the shards in every forward."""
    for r in scenario_results(results, "lbfgs"):
        stage3, stage2, _ = r["calls"]
        assert len(stage2) > 2  # evaluated between updates
        assert stage2 == stage3
        assert r["params_equal"]


def test_lbfgs_refreshes_on_every_rank_when_one_ranks_copies_are_stale(results):
    """Whether the closure refreshes the whole copies is decided by every rank together: a shard
    written in place on rank 1 alone (no value changed) makes rank 1's copy stale only, and
    rank 1 refreshing alone would pair its all-gather with rank 0's next collective."""
    for r in scenario_results(results, "lbfgs"):
        stage3, _, poked = r["calls"]
        assert poked == stage3
        assert r["poked_params_equal"]


def test_what_a_whole_tensor_step_sets_on_the_optimizer_is_set_once_per_step(results):
    """A subclass counting its steps on itself and in its param groups, stepped in windows of a
    few parameters: every window starts from the optimizer as it was before the step, and what
    the step set is kept once (before: once per window, and on the optimizer itself not at all)."""
    for r in scenario_results(results, "whole_counting_step"):
        assert r["windows"] > 1  # the step ran over several windows
        assert r["calls"] == 3
        assert r["steps_seen"] == [3]


def test_a_whole_tensor_step_that_raises_on_one_rank_raises_on_every_rank_and_changes_nothing(results):
    r0, r1 = scenario_results(results, "whole_failing_step")
    assert r1["raised"] == ("RuntimeError", "boom")
    assert r0["raised"][0] == "ZeroFXError" and "raised on another rank" in r0["raised"][1]
    for r in (r0, r1):
        assert r["unchanged"]  # shards and state as before the failed step, on both ranks
        assert r["moved"]  # the next step ran on both ranks (no hang) and stepped
        assert r["hooks_seen"] == ["_Flaky"] * 3  # the optimizer's own hooks, once per step


def test_whole_tensor_steps_of_layers_with_fewer_rows_than_ranks_match_the_unsharded_step(hybrid_results):
    # the (2, 16) weight over 4 ranks: split along dim 1 (zerofx's choice), or by rows
    for rank, r in enumerate(scenario_results(hybrid_results, "few_rows")):
        assert r["local_shapes"][2] == [2, 4]
        assert r["mismatched"] == [[]] * 3
    for rank, r in enumerate(scenario_results(hybrid_results, "few_rows_by_rows")):
        assert r["local_shapes"][2] == [1 if rank < 2 else 0, 16]
        assert r["mismatched"] == [[]] * 3


def test_owners_get_exactly_their_tensors_whatever_the_rows_per_rank(hybrid_results):
    """eager_buckets.py, NOTE: exact splits: each rank sends its real rows only, so an owner's
    lone tensor is the received buffer, exactly its bytes (a (2, 1000) tensor over 4 ranks would
    otherwise arrive padded to 4 rows), and the way back gives every rank its rows."""
    for rank, r in enumerate(scenario_results(hybrid_results, "exact_splits")):
        assert r["got_equal"] == [True] * {0: 1, 1: 2}.get(rank, 0)
        if rank == 0:
            assert r["got_bytes"] == [2 * 1000 * 4]
        assert r["back_equal"] == [True, True, True]
        assert r["small_back"] == [7.0, 8.0]


def test_lbfgs_refuses_unevenly_split_multi_dim_parameters_by_name(results):
    """LBFGS flattens every parameter through DTensor: over a 3-row layer on 2 ranks it failed
    inside DTensor ("Cannot flatten unevenly sharded tensor"); it is refused at its first step,
    naming the parameters, on every rank."""
    for r in scenario_results(results, "lbfgs_uneven"):
        assert r["lbfgs"].startswith("torch.optim.LBFGS flattens every parameter into one vector"), r["lbfgs"]
        assert "cannot flatten 0.weight [3, 4] (3 rows over 2 ranks): give" in r["lbfgs"], r["lbfgs"]
        # a 1-D parameter split unevenly (the 3-value bias, a LayerNorm(3)) flattens: not refused
        assert r["one_dim"] == "stepped", r["one_dim"]
