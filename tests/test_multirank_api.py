"""The public API on 2 gloo ranks: explain, the torch.compile pairing, eager fallback, pass
ablations, gradient clipping and state_dict on shards."""

from __future__ import annotations

import time

import pytest

from tests.api_scenarios import fail_on_rank_one, gathered_after_changes, grid_rank_differs, scenarios
from tests.multirank import run_ranks, scenario_results

WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(scenarios, WORLD, str(tmp_path_factory.mktemp("api_scenarios")))


def _get(results, name):
    return scenario_results(results, name)


def test_explain_reports_every_pass_and_collective(results):
    for r in _get(results, "explain"):
        report = r["report"]
        assert report == r["printed"].rstrip("\n")
        for expected in (
            "_joint:",
            "_forward:",
            "_backward:",
            "regather:",
            "gather:",
            "reduce:",
            "collective all_gather",
            "collective reduce_scatter",
            "saved for backward",
            "merged 1 gradient sum(s) of tied parameters",
        ):
            assert expected in report, expected
        assert r["grads_left"] == []  # explain leaves no gradients behind


def test_shard_then_torch_compile_backend_zerofx_trains_with_parity(results):
    for loss_err, param_err in _get(results, "two_step_pairing"):
        assert loss_err < 1e-5 and param_err < 1e-5


def test_eager_sharded_model_without_compile_is_correct(results):
    for loss_err, param_err in _get(results, "eager_sharded"):
        assert loss_err < 1e-5 and param_err < 1e-5


@pytest.mark.parametrize("pass_name", ["regather", "gather", "reduce"])
def test_every_pass_can_be_disabled_without_changing_numerics(results, pass_name):
    for r in _get(results, f"disabled_{pass_name}"):
        loss_err, param_err = r["errors"]
        assert loss_err < 1e-5 and param_err < 1e-5
        assert f"  {pass_name}:" not in r["summary"]


def test_explain_names_the_collectives_stages_1_and_2_run_outside_the_graphs(results):
    """Stage 1's end-of-backward reduce-scatter and the all-gather refreshing whole copies after a
    step run eagerly: explain showed no collective at all for stage 1 (its graphs have none)."""
    for r in _get(results, "explain_whole_copies"):
        assert "collective reduce_scatter" not in r[1] and "collective reduce_scatter" in r[2]
        for stage in (1, 2):
            assert "model_eager:" in r[stage] and "whole copies are all-gathered from the shards" in r[stage]
        assert "the whole gradients are reduce-scattered" in r[1]
        assert "the whole gradients are reduce-scattered" not in r[2]


def test_without_the_regather_pass_gathered_parameters_are_saved(results):
    """The reason the regather pass exists, measured: without it the forward keeps full weights."""
    with_regather = _get(results, "disabled_gather")[0]["summary"]
    without = _get(results, "disabled_regather")[0]["summary"]

    def saved_bytes(summary):
        line = next(l for l in summary.splitlines() if "saved for backward" in l)
        return int(line.split(", ")[1].split(" B")[0])

    assert saved_bytes(without) > saved_bytes(with_regather)
    assert "collective all_gather" in without  # the forward still gathers...
    backward = without.split("_backward:")[1]
    assert "collective all_gather" not in backward  # ...but the backward never re-gathers


def test_clip_grad_norm_on_shards_is_the_global_norm_and_state_dict_is_full_shape(results):
    for r in _get(results, "clip_and_state_dict"):
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)
        assert r["clipped_grad_err"] < 1e-7
        assert {k: shape for k, (_, shape) in r["state_dict"].items()} == r["ref_state_dict"]
        assert {kind for kind, _ in r["state_dict"].values()} == {"DTensor"}


def test_a_whole_plain_state_dict_loads_into_the_shards(results):
    """model.load_state_dict(torch.load("model.pt")) after zerofx.compile: every rank passes the
    whole, plain tensors and keeps its rows of them (stages 1-3, bf16 compute, a model built on
    the meta device, which then runs), where DTensor refused a plain tensor; the parameters come
    out exactly the loaded ones and the fp32 loss matches the source model's.
    A tensor of another shape still gets torch's size-mismatch error."""
    for r in _get(results, "whole_state_dict"):
        want, got = r["want"], r["got"]
        for label in ("stage1", "stage2", "stage3", "bf16", "stage1_assign", "stage3_assign"):
            assert got[label]["param_err"] == 0.0, (label, got[label])
        for label in ("stage1", "stage2", "stage3", "meta", "stage1_assign", "stage3_assign", "meta_assign"):
            assert abs(got[label]["loss"] - want) <= 1e-6 * abs(want), (label, got[label]["loss"], want)
        assert "size mismatch" in got["mismatch"], got["mismatch"]
        # built on meta and loaded part by part (model.encoder.load_state_dict(...)): each part
        # counts as loaded, the model refuses to run until the last part is in, then matches
        for label in ("meta_parts", "meta_parts_stage1"):
            assert abs(got[label]["loss"] - want) <= 1e-6 * abs(want), (label, got[label], want)
            early, last = got[f"{label}_early"], got[label]["last"]
            assert "were never loaded" in early and f"{last}." in early, (label, early)


def test_in_place_writes_to_a_gathered_weight_are_refused_not_lost(results):
    """model.block.weight outside a compiled graph is a copy gathered for the read: its values
    are the parameter's, and mul_, .data.clamp_, nn.init.normal_, item assignment, out= into it
    and .data = value (unless it holds the same values), which would change only the copy,
    raise naming the parameter (every label has its message: none was allowed); the parameter
    itself (a DTensor) takes the write on every rank's rows."""
    for r in _get(results, "gathered_copy_writes"):
        assert r["read_err"] == 0.0, r
        assert set(r["refused"]) == {"mul_", "data.clamp_", "init.normal_", "setitem", "out=", "data="}, r
        for label, message in r["refused"].items():
            assert message.startswith("blocks.0.fc.weight: ") and "would be lost" in message, (label, message)
        assert r["refused"]["data="].startswith("blocks.0.fc.weight: .data = ... would change a copy"), r
        assert r["halved_err"] == 0.0, r
        assert r["get_parameter"], r  # model.get_parameter(name): the DTensor, in a deep copy too
        grad_use, kept = r["grad"]
        assert kept, r["grad"]  # the parameter's own gradient is there
        for verb, label in (("reading", "read"), ("setting", "set")):
            message = grad_use[label]
            assert message.startswith(f"blocks.0.fc.weight: {verb} .grad of module.weight"), message
            assert "model.get_parameter('blocks.0.fc.weight').grad" in message, message


def test_writes_to_shards_that_no_refresh_followed_stop_the_next_forward(results):
    """Stages 1 and 2: a write to a parameter's shard that no refresh followed (an in-place op
    on the parameter, under zerofx.compile or the two-step pairing zerofx.shard +
    torch.compile(backend="zerofx"), torch.distributed.checkpoint.load into model.state_dict(), an
    AveragedModel's copy and _foreach_lerp_ updates) used to leave forward reading the old whole
    copy, silently. The next forward now raises naming the parameters; after refresh() the
    loss is the reference's (the model before the DCP-restored step, the EMA of a plain model).
    The EMA copy is a deepcopy on every rank, which torch's deepcopy of a DTensor fails on
    every rank but the first at stage 1; a deepcopy also trains as the reference's does (torch
    copies no tensor hooks, and the copy's gradients stayed pending: its loss never moved). A
    deepcopy taken after a backward holds the model's gradients in tensors of its own (it raised
    "invalid python storage": the gradients are views of the reduce-scatter's bucket)."""
    for r in _get(results, "stale_whole_copies"):
        trained, want, untrained = r["twin"]
        assert abs(trained - want) <= 1e-6 * abs(want) and abs(trained - untrained) > 1e-3, r["twin"]
        assert r["held_grads"] is True, r["held_grads"]  # a deepcopy taken with gradients held
        for label, (stale, refreshed, want) in r["stale"].items():
            assert isinstance(stale, str) and "changed in place since zerofx last refreshed" in stale, (label, stale)
            assert stale.startswith("wte.weight, "), (label, stale)
            assert abs(refreshed - want) <= 1e-6 * abs(want), (label, refreshed, want)
        assert set(r["stale"]) >= {"stage1_compile", "stage2_compile", "stage2_two_step"}, sorted(r["stale"])


def test_parameters_frozen_when_sharded_train_once_unfrozen(results):
    """Parameters frozen when sharded had no gradient sink, so once unfrozen, at stage 1 (which
    accumulates local gradients in sinks) and in a no_sync window at any stage, their gradient
    was dropped silently and they never moved. And ``module.weight.requires_grad_(True)`` (or
    ``= True``) set the flag of the copy gathered for that read, not the parameter's. Now they
    train as the plain model's do. A module added after sharding is refused at its first step,
    compiled or not, and so is a forward that reads parameters through a list made before
    sharding (the old tensors trained, silently, and the shards never moved)."""
    for r in _get(results, "unfrozen_later"):
        added, uncompiled = r.pop("added"), r.pop("added_uncompiled")
        # parameters read through a list made before sharding: the old tensors trained, silently
        # (uncompiled); compiled, the refusal blamed a module added after sharding
        kept = r.pop("kept_True"), r.pop("kept_False")
        for message in kept:
            assert message is not None and "forward reads parameters as they were before zerofx sharded" in message
        assert "ws.0 (the model's 'mlp.layers.0.weight')" in kept[0], kept[0]
        assert "'mlp.layers.2.weight'" in kept[1], kept[1]  # the first the backward reaches
        shared = r.pop("shared_later")
        assert shared is not None and "0.weight (which was '0.weight' of the module sharded first)" in shared, shared
        assert "shared with a module zerofx sharded before" in shared, shared
        assert set(r) == {"stage1", "stage3"}, r
        for stage, (worst, moved) in r.items():
            assert moved and worst <= 1e-5, (stage, worst, moved)
        # a module added after sharding trained each rank's own copy, silently; now it is
        # refused, by the backend for a compiled frame and by a forward pre-hook without compile
        for message in (added, uncompiled):
            assert message is not None and "layers.3.weight, layers.3.bias: trainable parameter(s)" in message, message
            assert "added after it was sharded" in message, message


def test_ranks_that_route_to_other_experts_stop_at_stage_3_and_train_at_stage_1(results):
    """An MoE that skips the experts no token of the rank was routed to makes each rank run
    other graphs. At stage 3 their gathers paired one expert's rows with another's, and gloo
    aborted the process on the first size that differed (NCCL would wait forever). Now every
    rank raises before the graph's collectives, naming what each rank was about to read. Stage 1
    gathers nothing in its graphs; its boundary reduce covered only the parameters this rank
    had gradients for, so it aborted the same way. Now every rank reduces every parameter some
    rank used, and the run matches the unsharded reference bit for bit. An uncompiled model
    (``zerofx.shard`` alone) is checked read by read."""
    per_rank = _get(results, "routed_experts")
    for r in per_rank:
        raised = r["stage3"]
        assert raised is not None and "about to issue different collectives" in raised, raised
        # each rank's first expert: the batch routes rank 0 to experts 1 and 2, rank 1 to 3 and 4,
        # each run by one compiled Linear.forward (dynamo gives a frame's parameters as inputs)
        assert "rank(s) [0]: the forward graph of" in raised, raised
        assert "(1 all_gather), reading experts.1.weight; rank(s) [1]: the forward graph of" in raised, raised
        assert "(1 all_gather), reading experts.3.weight. This usually means" in raised, raised
        # stage 2 gathers nothing in forward, and its backward's reduce-scatters name no parameter
        at_stage2 = r["stage2"]
        assert at_stage2 is not None and "(no collective), reading experts.1.weight; rank(s) [1]" in at_stage2, (
            at_stage2
        )
        report = r["stage1"]
        assert not report["problem"] and len(report["steps"]) == 3, report
        assert report["ok"] and report["first_divergence"] is None, report
        # uncompiled (zerofx.shard alone), each read gathers: checked read by read
        eager = r["uncompiled"]
        assert eager is not None and "rank(s) [0]: an uncompiled read of experts.1.weight; " in eager, eager
        assert "rank(s) [1]: an uncompiled read of experts.3.weight. This usually means" in eager, eager
        # and the backward's reductions, before their collectives: rank 1 did not read `extra`
        skipped = r["uncompiled_skipped"]
        assert skipped is not None and "rank(s) [0]: an uncompiled read of extra; " in skipped, skipped
        assert "rank(s) [1]: the uncompiled backward's reduction of lin." in skipped, skipped
    assert per_rank[0]["stage3"] == per_rank[1]["stage3"]
    assert per_rank[0]["rank0_read"] > 0  # a stage-2 read on rank 0 only did not wait for rank 1
    assert per_rank[0]["rank0_eval"] > 0  # nor did a compiled stage-2 evaluation (no collective)


def test_parameters_read_from_eager_code_inside_the_compiled_call_train_as_unsharded(results):
    """A forward loop that dynamo runs eagerly (a data-dependent index inside it) reads each
    layer's parameters from eager code: twelve reads of distinct names and shapes, past dynamo's
    recompile limit, so the later ones are uncompiled reads (NOTE: reads from eager code inside a
    compiled region, zerofx/sharding.py). Stages 3 and 1 train two steps as the unsharded
    reference does, bit for bit (the oracle's verdict); every rank used to raise torch's
    "Multiple dispatch failed"."""
    for r in _get(results, "eager_reads"):
        for stage, report in r.items():
            assert not report["problem"] and len(report["steps"]) == 2, (stage, report)
            assert report["ok"] and report["first_divergence"] is None, (stage, report)


def test_lockstep_checks_of_a_mesh_on_nccl_run_on_gloo_groups_of_the_same_ranks(results):
    for r in _get(results, "lockstep_twin"):
        assert r["twin"] and r["backend"] == "gloo" and r["shared"], r
        assert r["raised"] is not None and "rank(s) [0]: digest 0; rank(s) [1]: digest 1" in r["raised"], r


def test_checkpoints_and_torchs_state_dict_helpers_gather_no_parameter(results):
    for r in _get(results, "dcp_gathers"):
        assert r == {"read": 1, "get_state_dict": 0, "save": 0, "load": 0}, r


def test_a_rank_outside_the_mesh_is_told_so(results):
    rank0, rank1 = _get(results, "outside_mesh")
    assert rank0["raised"] is None, rank0  # the mesh's own rank shards alone
    assert rank1["raised"] == (
        "ZeroFXError: this rank (1) is not in the mesh (ranks [0]): call zerofx.compile only on the ranks of its "
        "mesh, or build the mesh over every rank"
    ), rank1


def test_a_submodule_loaded_mid_training_refreshes_its_whole_copies(results):
    for r in _get(results, "submodule_load"):
        assert set(r) == {f"{k}stage{s}" for k in ("", "gathers_", "after_raise_") for s in (1, 2)}, r
        for stage in ("stage1", "stage2"):
            for got in (r[stage], r[f"after_raise_{stage}"]):
                assert isinstance(got, tuple), (stage, got)
                assert abs(got[0] - got[1]) <= 1e-6 * abs(got[1]), (stage, got)
            assert r[f"gathers_{stage}"] == 1, r  # one bucketed refresh for the whole load


def test_a_penalty_over_the_shards_outside_forward_is_a_clear_error(results):
    for r in _get(results, "penalty_outside_forward"):
        for stage in (1, 3):
            message = r[f"stage{stage}"]
            assert "the loss's gradient reaches the zerofx-compiled forward as a DTensor" in message, (stage, message)
            assert "p.full_tensor()" in message, message
            got, want, worst = r[f"whole_stage{stage}"]
            assert abs(got - want) <= 1e-6 * abs(want) and worst <= 1e-6, (stage, got, want, worst)


def test_share_memory_moves_the_shards_and_the_model_still_trains(results):
    for r in _get(results, "share_memory"):
        assert r["shared"], r
        assert abs(r["loss"] - r["want"]) <= 1e-6 * abs(r["want"]), r


def test_ranks_that_shard_another_model_or_options_stop_with_the_difference(results):
    rank0, rank1 = _get(results, "ranks_disagree")
    first_difference = {
        "width": "Here: parameter wte.weight: shape (96, 48), torch.float32, requires_grad=True; "
        "on rank 0: parameter wte.weight: shape (96, 32)",
        "depth": "Here: parameter blocks.2.ln1.weight: shape (32,), torch.float32, requires_grad=True; "
        "on rank 0: parameter ln_f.weight",
        "stage": "Here: option stage=2; on rank 0: option stage=3",
        "frozen": "Here: parameter wte.weight: shape (96, 32), torch.float32, requires_grad=False; "
        "on rank 0: parameter wte.weight: shape (96, 32), torch.float32, requires_grad=True",
    }
    for case, detail in first_difference.items():
        assert rank0[case] is not None and "rank(s) [1] shard another model or options than rank 0" in rank0[case]
        assert rank1[case] is not None and "this rank (1) differs from rank 0" in rank1[case], rank1[case]
        assert detail in rank1[case], (case, rank1[case])
    assert rank0["host_memory_cap"] is None and rank1["host_memory_cap"] is None  # a per-rank option


def test_a_rank_that_differs_on_a_2d_mesh_stops_every_rank():
    errors, routed, two_models = zip(*run_ranks(grid_rank_differs, 4, timeout=180))
    assert all(e is not None for e in errors), errors
    # rank 3 routes to other experts: its two groups see it, the others learn it in the second round
    assert all(r is not None and "about to issue different collectives" in r for r in routed), routed
    assert "ranks of another group differ" in routed[0], routed[0]
    mine, replica, shard_peer = "reading experts.2.weight", "rank(s) [1]: ", "rank(s) [2]: "
    assert replica in routed[3] and shard_peer in routed[3] and mine in routed[3], routed[3]
    assert "reading experts.0.weight" in routed[1] and mine in routed[1], routed[1]
    assert "ranks of another group differ" in errors[0]  # rank 0 shares no group with rank 3
    assert "rank(s) [3] shard another model or options than rank 1" in errors[1]
    assert "this rank (3) differs from rank 1" in errors[3] and "shape (96, 48)" in errors[3], errors[3]
    # a frame reading a model sharded over pairs of ranks and one sharded over all four, in
    # another order on odd ranks: the ranks of each pair check the same groups in the same order
    # (in input order they waited in different groups), and every rank stops before a collective
    for r in two_models:
        assert r is not None and "about to issue different collectives" in r, two_models
        # the four-rank group's line, last: what each rank was about to read (odd ranks: whole first)
        assert "rank(s) [0]: the forward graph of" in r and "reading weight, bias, 0.weight and 3 more; " in r, r
        assert "rank(s) [1]: the forward graph of" in r and "rank(s) [2]: the forward graph of" in r, r
        assert "rank(s) [3]: the forward graph of" in r, r
        assert "reading 0.weight, 0.bias, weight and 1 more. This usually" in r, r


def test_a_failing_rank_ends_the_run_promptly_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        run_ranks(fail_on_rank_one, WORLD, timeout=120)
    assert time.monotonic() - start < 60


def test_accumulation_windows_zero_grad_step_refusal_and_hooks(results):
    """zero_grad drops an abandoned no_sync window as DDP's does; a step over unreduced
    gradients is an error; hooks run once per reduction at every stage (tests/api_scenarios.py)."""
    per_rank = _get(results, "accumulation_windows")
    # hooks on one rank only: every rank raises together (no rank left waiting in a collective),
    # and the rank that sees the difference names it
    assert all("every rank must shard the same model" in r["hooked_on_rank0"] for r in per_rank), per_rank
    assert any("gradient hooks" in r["hooked_on_rank0"] for r in per_rank), per_rank
    for r in per_rank:
        for stage in ("stage1", "stage2", "stage3"):
            got = r[stage]
            assert got["dropped"] == {"model": 0.0, "optimizer": 0.0}, (stage, got["dropped"])
            assert "whose gradients from a backward under zerofx.no_sync" in got["refused"], (stage, got["refused"])
            for window, h in got["hooked"].items():
                assert h["err"] <= 1e-7, (stage, window, h)
                assert h["calls"] == ["bias", "weight"], (stage, window, h)
        assert "weight: gradient hooks registered before zerofx sharded the model" in r["hooked_before"]


def test_a_forward_inside_gathered_after_the_parameters_changed_refuses_at_stage_3():
    """Stage 3's gathered copies were taken once: an optimizer step or load_state_dict inside
    zerofx.gathered went unseen, and its forwards computed with the old weights (outputs 86 off
    the model's after the context). Now such a forward refuses; stages 1-2 read the whole
    copies, which follow the step and the load."""
    for r in run_ranks(gathered_after_changes, WORLD, timeout=300):
        for stage in (1, 2):
            assert r[f"step_{stage}"] is True and r[f"load_{stage}"] is True, (stage, r)
        for change in ("step", "load"):
            assert "changed inside zerofx.gathered(model)" in str(r[f"{change}_3"]), r[f"{change}_3"]
        assert all(r[f"again_{stage}"] for stage in (1, 2, 3)), r
