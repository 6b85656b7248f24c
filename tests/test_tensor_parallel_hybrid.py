"""Hybrid sharding next to tensor parallelism: zerofx on the (replicate, shard) dimensions of a
2x2x2 (replicate, shard, tp) gloo mesh, the model parallelized with torch's tensor parallelism
on the third (torchtitan's HSDP + TP), and ZeRO++ hpZ over the same two data-parallel dimensions.

Parity bit for bit with the oracle (``zerofx.testing.ShardedReference``, which combines each TP
coordinate's data-parallel gradients as zerofx does: the shard dimension's sum, then the
replicate dimension's), within fp32 reassociation of the single process; the optimizer's 3-D
placements; per-rank memory; collective bytes per mesh dimension against the formulas and the
planner (``zerofx.plan(mesh_shape=(2, 2), tensor_parallel=2)``); inference inside
``zerofx.gathered``; a whole-tensor optimizer step; and a DCP checkpoint saved from the hybrid
layout loaded back into it and into (dp=4, tp=2).

One 8-rank process group (2 cores: 4x oversubscribed, about 2 minutes of setup and compiles)
runs every scenario once (tests/tp_scenarios.py); the tests read its results.
"""

from __future__ import annotations

import pytest

from tests import tp_scenarios
from tests.multirank import run_ranks

# eight ranks on two cores: `tox -e slow` (pytest -m slow), not the default run
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

HYBRID = {"layout": "2x2x2"}
CALLS = [
    ("parity", {"model": "gpt", "stage": 3, "clip": 1.0, **HYBRID}),
    ("parity", {"model": "llama", "stage": 2, "tp_dim": "tp", **HYBRID}),
    ("parity", {"model": "gpt", "stage": 1, **HYBRID}),
    ("parity", {"model": "gpt", "stage": 3, "secondary_shard": True, **HYBRID}),
    ("parity", {"model": "llama", "stage": 3, "secondary_shard": True, "clip": 1.0, **HYBRID}),
    ("memory", {"model": "gpt", "stage": 3, **HYBRID}),
    ("collective_bytes", {"model": "gpt", **HYBRID}),
    ("collective_bytes", {"model": "gpt", "secondary_shard": True, **HYBRID}),
    ("gathered", {"model": "gpt", **HYBRID}),
    ("whole_step", {"model": "gpt", "optimizer": "adafactor", **HYBRID}),
    ("meta_built", {"model": "llama", **HYBRID}),
    ("ragged_share", {"model": "linear", **HYBRID}),
]
CHECKPOINT = ("checkpoint_layouts", {"model": "gpt", "stage": 3, "saved_in": "2x2x2"})
LOADS = (("2x2x2", 3), ("4x2", 3))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp("hybrid_tp"))
    checkpoint = (CHECKPOINT[0], {**CHECKPOINT[1], "folder": folder, "loads": LOADS})
    per_rank = run_ranks(tp_scenarios.run, 8, [*CALLS, checkpoint], timeout=1500)
    return {i: [r[i] for r in per_rank] for i in range(len(CALLS) + 1)}


def _ok(results: dict, name: str, **kwargs) -> list[dict]:
    i = len(CALLS) if name == CHECKPOINT[0] else CALLS.index((name, {**kwargs, **HYBRID}))
    ranks = results[i]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    assert len(ranks) == 8
    return [r["ok"] for r in ranks]


EXACT = [kwargs for name, kwargs in CALLS if name == "parity"]


@pytest.mark.parametrize("kwargs", EXACT, ids=lambda k: "-".join(f"{v}" for key, v in k.items() if key != "layout"))
def test_fp32_matches_the_oracle_bit_for_bit_and_the_single_process_to_reassociation(results, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != "layout"}
    for r in _ok(results, "parity", **kwargs):
        assert r["oracle_equal"] == [True] * 3, "a loss differs from the TP model's without zerofx"
        assert r["divergences"] == [], r["divergences"][:3]
        assert r["losses"] == pytest.approx(r["single"], rel=tp_scenarios.SINGLE_RTOL)
        for ours, single in r["norms"]:  # clip_grad_norm_ over 3-D DTensors: the global norm
            assert ours == pytest.approx(single, rel=tp_scenarios.SINGLE_RTOL)
        assert len(r["norms"]) == (3 if "clip" in kwargs else 0)


def test_the_optimizer_sees_3d_placements_replicated_sharded_then_tp(results):
    placements = _ok(results, "parity", model="gpt", stage=3, clip=1.0)[0]["placements"]
    # column-wise: TP shards rows, the shard dim splits each TP share again, replicate copies it
    assert placements["blocks.0.attn.qkv.weight"] == ["R", "_S(0, 2)", "S(0)"]
    assert placements["blocks.0.out.weight"] == ["R", "S(0)", "S(1)"]  # row-wise: TP shards columns
    assert placements["blocks.0.ln1.weight"] == ["R", "S(0)", "R"]  # sequence-parallel norm
    # hpZ: the primary partition spans both data-parallel dims (one flattened mesh dim)
    hpz = _ok(results, "parity", model="gpt", stage=3, secondary_shard=True)[0]["placements"]
    assert hpz["blocks.0.attn.qkv.weight"] == ["_S(0, 2)", "S(0)"]
    assert hpz["blocks.0.ln1.weight"] == ["S(0)", "R"]


def test_memory_per_rank_is_model_state_over_shard_times_tp(results):
    for r in _ok(results, "memory", model="gpt", stage=3):
        # numel/(shard*tp) for what TP shards, numel/shard for what it replicates: the
        # replicate dim holds copies
        assert r["params"] == r["expected"]
        assert r["state"] == 2 * r["expected"]  # AdamW: exp_avg, exp_avg_sq
        assert r["params"] < r["whole"] / 3
        assert r["tp_sharded"] > 0


def _tp_bytes_are_the_tp_models_own(r: dict) -> None:
    fw, bw = r["forward"], r["backward"]
    assert fw["tp"] == r["tp_forward"]["tp"]
    expected_bw = dict(r["tp_backward"].get("tp", {}))
    if r["tp_partial_all_reduce"]:
        expected_bw["all_reduce"] = expected_bw.get("all_reduce", 0) + r["tp_partial_all_reduce"]
    assert bw["tp"] == expected_bw


def test_hybrid_collectives_per_mesh_dimension_match_the_formulas(results):
    for r in _ok(results, "collective_bytes", model="gpt"):
        share = r["psi_tp_share"]  # Ψ_tp·(shard-1)/shard
        fw, bw = r["forward"], r["backward"]
        # the shard dim runs ZeRO-3's gather, re-gather and reduce-scatter; the replicate dim
        # all-reduces each rank's reduced gradient shard (Ψ_tp/shard: wire 2·(r-1)/r of it)
        assert fw == {"shard": {"all_gather": pytest.approx(share, abs=8)}, "tp": fw["tp"]}
        assert bw["shard"]["reduce_scatter"] == pytest.approx(share, abs=8)
        assert 0 < bw["shard"]["all_gather"] <= share + 8
        assert bw["replicate"] == {"all_reduce": pytest.approx(2 * (r["psi_tp"] / 2) * (1 / 2), abs=16)}
        _tp_bytes_are_the_tp_models_own(r)
        assert set(fw) | set(bw) == {"shard", "replicate", "tp"}


def test_hpz_with_tp_never_regathers_across_the_replicate_dimension(results):
    for r in _ok(results, "collective_bytes", model="gpt", secondary_shard=True):
        psi = r["psi_tp"]
        fw, bw = r["forward"], r["backward"]
        # forward gathers over all 4 data-parallel ranks, the gradient reduce-scatters over them;
        # the backward's re-gather stays inside the shard dim; no replicate all-reduce
        assert fw == {"all": {"all_gather": pytest.approx(psi * 3 / 4, abs=16)}, "tp": fw["tp"]}
        assert bw["all"] == {"reduce_scatter": pytest.approx(psi * 3 / 4, abs=16)}
        # each rank kept its shard-dim rows (1/shard) of every gathered value: the re-gather of
        # a whole TP-local value within the shard dim is (shard-1)/shard of it
        assert 0 < bw["shard"]["all_gather"] <= psi / 2 + 8
        assert "replicate" not in bw
        _tp_bytes_are_the_tp_models_own(r)


@pytest.mark.parametrize("hpz", [False, True], ids=["hybrid", "hpz"])
def test_the_planner_predicts_the_2x2x2_run(results, hpz):
    """``zerofx.plan`` with ``mesh_shape=(2, 2), tensor_parallel=2`` (a fake process group in
    this process) against what the 8 ranks measured: parameter bytes per rank and collective
    bytes per mesh dimension."""
    from zerofx.planner import plan

    options = {"secondary_shard": True} if hpz else {}
    p = plan(
        tp_scenarios.gpt, (2, 2), tensor_parallel=2, batch=tp_scenarios.PER_DP_RANK, seq=16, device="cpu", **options
    )
    assert p.world_size == 8 and p.mesh == {"replicate": 2, "shard": 2, "tp": 2}
    if not hpz:
        measured = _ok(results, "memory", model="gpt", stage=3)[0]
        assert p.per_rank.params_bytes == 4 * measured["params"]
    comm = _ok(results, "collective_bytes", model="gpt", **options)[0]
    for kind, dims in p.comm_bytes_per_step.items():
        for dim, nbytes in dims.items():
            ran = comm["forward"].get(dim, {}).get(kind, 0) + comm["backward"].get(dim, {}).get(kind, 0)
            assert nbytes == ran, (kind, dim)
    ran_kinds = {k for phase in ("forward", "backward") for d in comm[phase].values() for k in d}
    assert set(p.comm_bytes_per_step) == ran_kinds


def test_inference_inside_gathered_reads_each_rank_tp_share(results):
    for r in _ok(results, "gathered", model="gpt"):
        assert r["shape"] == [2, 16, 64]
        assert r["max_diff"] == 0.0
        assert r["nbytes"] > 0


def test_a_whole_tensor_step_over_hybrid_and_tp_shares_matches_the_unsharded_step(results):
    for r in _ok(results, "whole_step", model="gpt", optimizer="adafactor"):
        assert r["tp_sharded"]
        assert all(r["moved"])
        assert r["params"] == [[], [], []]
        assert r["state"] == [[], [], []]


def test_a_hybrid_checkpoint_loads_into_hybrid_and_into_4x2_and_trains_on(results):
    for r in _ok(results, "checkpoint_layouts"):
        for layout, stage in LOADS:
            got = r[f"{layout}/stage{stage}"]
            assert got["differs_before"], "the fresh model already held the saved values: the test cannot tell"
            assert got["differs"] == [], got["differs"][:5]
            assert got["keys"] == r["saved"]
            assert got["extra"] == {"step": 2}
            if layout == "2x2x2":  # the same arithmetic
                assert got["losses"] == r["uninterrupted"]
            else:  # the data-parallel sum over 4 ranks in one reduce-scatter: another association
                assert got["losses"] == pytest.approx(r["uninterrupted"], rel=tp_scenarios.SINGLE_RTOL)


def test_a_model_built_on_meta_over_hybrid_and_tp_holds_its_shares_and_loads_every_way(results):
    """The models this layout exists for do not fit one rank: built on meta over 2x2x2, each rank
    allocates only its shard-dim rows of its TP share, and the three loads fill them."""
    from tests.test_tensor_parallel import check_meta_built

    check_meta_built(_ok(results, "meta_built", model="llama"))


def test_a_layout_some_ranks_cannot_hold_is_an_error_on_every_rank(results):
    """A TP share whose rows zerofx's data-parallel split and DTensor's strided layout place
    differently at some mesh coordinates only: every rank raises, naming the first rank that holds
    such rows (it had raised on ranks 6 and 7 only; the others went on into the next parameter's
    collective)."""
    got = _ok(results, "ragged_share", model="linear")
    assert all(g.startswith("ZeroFXError: 0.weight: its tensor-parallel share (97, 16) -> ") for g in got), got
    # ranks 6 and 7 (data-parallel coordinate 3) hold rows DTensor would not give them; the rest
    # name the lowest of those
    assert [("this rank" in g, "rank 6 (not this one)" in g) for g in got] == [(False, True)] * 6 + [(True, False)] * 2
