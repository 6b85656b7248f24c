"""ZeRO stages 1/2/3, persistence, mixed precision, accumulation, clipping, hybrid sharding and
sharded checkpoints, on 2 and 4 gloo ranks against an unsharded single-process reference.

One multi-process run per world size trains every scenario (tests/zero_scenarios.py); the
4-rank run writes the checkpoint the 2-rank run reshards. Each test asserts one property.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import WHOLE, UnevenNet
from tests.multirank import replayed, run_ranks
from tests.zero_scenarios import scenarios_w2, scenarios_w4

STEPS = 3
STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    recorded = replayed("stages")  # a stress run's results, judged here (tests/stress.py)
    return Path(recorded["folder"]) if recorded else tmp_path_factory.mktemp("zero_ckpt")


@pytest.fixture(scope="module")
def runs(folder):
    recorded = replayed("stages")
    if recorded:
        return lambda world_size: recorded[world_size]
    cache: dict[int, list[dict]] = {}

    def get(world_size: int) -> list[dict]:
        if world_size == 2 and 4 not in cache:
            get(4)  # the 2-rank run loads the checkpoint the 4-rank run saves
        if world_size not in cache:
            fn = scenarios_w4 if world_size == 4 else scenarios_w2
            cache[world_size] = run_ranks(fn, world_size, STEPS, str(folder), timeout=600)
        return cache[world_size]

    return get


def _case(runs, world_size: int, name: str) -> list[dict]:
    per_rank = [r[name] for r in runs(world_size)]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank} failed:\n{r['error']}"
    return per_rank


def _assert_parity(per_rank: list[dict], bounded: tuple[str, ...] = ()) -> None:
    """Bit for bit against zerofx.testing.ShardedReference: every micro-batch loss, gradient and
    parameter shard, buffer, every step; only ``bounded`` parameters (reduced by a backend
    all-reduce over more than two ranks) may instead sit within the any-order summation bound.
    The whole-batch reference's own check, with its measured tolerance, is tests/test_parity.py."""
    for rank, r in enumerate(per_rank):
        assert not r["failures"], f"rank {rank}: " + "\n".join(r["failures"][:10])
        assert set(r["bounded"]) <= set(bounded), r["bounded"]


PARITY = (
    [(2, f"{m}_stage{s}") for s in STAGES for m in ("mlp", "uneven")]
    + [(4, f"{m}_stage{s}") for s in STAGES for m in ("mlp", "uneven")]
    + [(2, "gpt_stage1"), (2, "gpt_stage2"), (2, "gpt_persist")]
    + [(2, "uneven_stage1_small_buckets"), (2, "accum_clip_stage2_small_buckets")]
    + [(4, f"hybrid_mlp_stage{s}") for s in STAGES]
    + [(4, "hybrid_mlp_persist")]
    + [(w, f"experts_stage{s}") for w in (2, 4) for s in STAGES]
    + [(4, "hybrid_experts_stage3"), (4, "experts_hpz")]
)


def _all_reduced(world_size: int, name: str) -> tuple[str, ...]:
    """The parameters whose gradients a backend all-reduce sums in its own order (tests.models.WHOLE)."""
    return WHOLE["uneven"] if world_size > 2 and "uneven" in name else ()


@pytest.mark.parametrize("world_size,name", PARITY)
def test_every_stage_trains_like_the_unsharded_reference(runs, world_size, name):
    """Losses, every local gradient shard and every parameter shard, every step, bit for bit."""
    _assert_parity(_case(runs, world_size, name), bounded=_all_reduced(world_size, name))


@pytest.mark.parametrize("world_size,stage", [(w, s) for w in (2, 4) for s in STAGES])
def test_accumulation_with_no_sync_and_clipping_match_one_big_batch(runs, world_size, stage):
    for r in _case(runs, world_size, f"accum_clip_stage{stage}"):
        # the global norm: checked in the failures against the reference's within the bound for
        # a sum of squares in any order; here only that clipping really scaled the gradients
        assert max(r["norms"]) > 0.05  # clipping really scaled the gradients
    _assert_parity(_case(runs, world_size, f"accum_clip_stage{stage}"), bounded=_all_reduced(world_size, "uneven"))


def test_accumulation_with_tied_weights_in_stage_3(runs):
    _assert_parity(_case(runs, 2, "gpt_accum_clip_stage3"))


# --- memory: the ZeRO paper's model-state formulas, from numel ------------------------------


def _expected_state(stage: int, psi: int, n: int, *, bf16: bool = False) -> dict:
    """Model-state bytes per rank for AdamW (two fp32 moments) with Ψ = fp32 parameter bytes.

    fp32 (the paper's formulas with an fp32 parameter as "the" parameter):
        stage 1: params Ψ,  grads Ψ,  optimizer 2Ψ/N
        stage 2: params Ψ,  grads Ψ/N, optimizer 2Ψ/N
        stage 3: params Ψ/N, grads Ψ/N, optimizer 2Ψ/N
    bf16 compute, fp32 masters (docs/zero_stages.md): stages 1/2 hold a bf16 whole copy (Ψ/2)
    next to the fp32 master shard (Ψ/N); gradients are fp32 (stage 1's whole buffer is the
    fp32 accumulation buffer)."""
    opt = 2 * psi // n
    if not bf16:
        return {
            1: dict(params=psi, grads=psi, optimizer=opt),
            2: dict(params=psi, grads=psi // n, optimizer=opt),
            3: dict(params=psi // n, grads=psi // n, optimizer=opt),
        }[stage]
    whole_copy = psi // 2 + psi // n
    return {
        1: dict(params=whole_copy, grads=psi, optimizer=opt),
        2: dict(params=whole_copy, grads=psi // n, optimizer=opt),
        3: dict(params=psi // n, grads=psi // n, optimizer=opt),
    }[stage]


@pytest.mark.parametrize("stage", (1, 2))
def test_every_rank_pickles_and_copies_its_state_dict_at_stages_1_and_2(runs, stage):
    """torch.save(model.state_dict()) and copy.deepcopy of it on every rank: rank 1's shards
    start past their storage's first element (views of the whole copy), which made both fail
    there and only there (zerofx/sharding.py, ``_save_aliasing_shards``)."""
    per_rank = _case(runs, 2, f"state_dict_pickles_stage{stage}")
    assert per_rank[1]["offsets"][-1] > 0  # the case the fix is for is exercised
    for rank, r in enumerate(per_rank):
        assert r["versions_kept"] and r["keys"] and r["saved_equal"] and r["copied_equal"], (rank, r)


@pytest.mark.parametrize("world_size,stage", [(w, s) for w in (2, 4) for s in STAGES])
def test_model_state_memory_per_stage_matches_zero_formulas(runs, world_size, stage):
    for r in _case(runs, world_size, f"mlp_stage{stage}"):  # every dim 0 divisible by 2 and 4
        assert r["state"] == _expected_state(stage, r["acc"]["psi"], world_size)


@pytest.mark.parametrize(
    "world_size,name,stage",
    [(2, "mlp_bf16_stage1", 1), (2, "mlp_bf16_stage2", 2), (2, "mlp_bf16_stage3", 3), (4, "mlp_bf16_stage3", 3)],
)
def test_model_state_memory_with_bf16_compute(runs, world_size, name, stage):
    for r in _case(runs, world_size, name):
        assert r["state"] == _expected_state(stage, r["acc"]["psi"], world_size, bf16=True)


@pytest.mark.parametrize("stage", STAGES)
def test_hybrid_memory_is_divided_by_the_shard_dimension_only(runs, stage):
    for r in _case(runs, 4, f"hybrid_mlp_stage{stage}"):  # 2x2: sharded over 2, replicated over 2
        assert r["state"] == _expected_state(stage, r["acc"]["psi"], 2)


def test_persistent_parameters_stay_whole(runs):
    for r in _case(runs, 2, "gpt_persist"):
        acc = r["acc"]
        assert 0 < acc["psi_whole"] < acc["psi"] / 10  # LayerNorm weights and biases
        sharded = acc["psi"] - acc["psi_whole"]
        assert r["state"]["params"] == sharded // 2 + acc["psi_whole"]


# --- communication per step ------------------------------------------------------------------


def _share(n: int) -> float:
    return (n - 1) / n


@pytest.mark.parametrize("world_size,stage", [(w, s) for w in (2, 4) for s in STAGES])
def test_communication_per_step_per_stage(runs, world_size, stage):
    """Stages 1-2 move 2·Ψ·(N-1)/N per step, stage 3 3·Ψ·(N-1)/N (MLP: backward reads every weight)."""
    for r in _case(runs, world_size, f"mlp_stage{stage}"):
        psi_s = r["acc"]["psi"] * _share(world_size)
        comm = r["comm"]
        total = sum(sum(phase.values()) for phase in comm.values())
        if stage == 3:
            assert comm == {
                "forward": {"all_gather": psi_s},
                "backward": {"all_gather": psi_s, "reduce_scatter": psi_s},
                "step": {},
            }
            assert total == 3 * psi_s
        else:  # no communication in forward; one reduce-scatter in backward, one all-gather after the step
            assert comm == {"forward": {}, "backward": {"reduce_scatter": psi_s}, "step": {"all_gather": psi_s}}
            assert total == 2 * psi_s


@pytest.mark.parametrize("world_size,stage", [(2, 1), (2, 2), (2, 3), (4, 3)])
def test_bf16_gathers_move_half_the_bytes(runs, world_size, stage):
    for r in _case(runs, world_size, f"mlp_bf16_stage{stage}"):
        psi_s = r["acc"]["psi"] * _share(world_size)
        comm = r["comm"]
        gathered = (
            comm["forward"].get("all_gather", 0)
            + comm["backward"].get("all_gather", 0)
            + comm["step"].get("all_gather", 0)
        )
        assert gathered == (psi_s if stage == 3 else psi_s / 2)  # fp32 would be 2Ψs and Ψs
        assert comm["backward"]["reduce_scatter"] == psi_s  # gradients reduced in fp32 (the default)


@pytest.mark.parametrize("world_size,stage", [(w, s) for w in (2, 4) for s in STAGES])
def test_no_sync_reduces_once_per_accumulation_cycle(runs, world_size, stage):
    accum = 3 if world_size == 2 else 2
    for r in _case(runs, world_size, f"accum_clip_stage{stage}"):
        psi_pad_s = r["acc"]["psi_pad"] * _share(world_size)
        comm = r["comm"]
        assert comm["backward"]["reduce_scatter"] == pytest.approx(psi_pad_s, abs=8)  # not accum times
        if stage == 3:  # parameters are still gathered for every micro-batch's forward
            assert comm["forward"]["all_gather"] == pytest.approx(accum * psi_pad_s, abs=8)


def test_hybrid_stage3_reduce_scatters_within_and_all_reduces_across(runs):
    for r in _case(runs, 4, "hybrid_mlp_stage3"):
        psi = r["acc"]["psi"]
        comm = r["comm"]  # shard groups of 2: (N-1)/N = 1/2; replicas of 2 all-reduce a Ψ/2 shard
        assert comm["forward"] == {"all_gather": psi / 2}
        assert comm["backward"] == {"all_gather": psi / 2, "reduce_scatter": psi / 2, "all_reduce": 2 * (psi / 2) / 2}


def test_persistent_parameters_are_all_reduced_not_gathered(runs):
    for r in _case(runs, 2, "gpt_persist"):
        acc, comm = r["acc"], r["comm"]
        sharded_s = (acc["psi"] - acc["psi_whole"]) / 2
        assert comm["backward"]["all_reduce"] == 2 * acc["psi_whole"] / 2
        assert comm["forward"]["all_gather"] == sharded_s
        assert comm["backward"]["reduce_scatter"] == sharded_s


# --- mixed precision -------------------------------------------------------------------------

# bf16 keeps 8 significant bits: every rounding is off by at most 2^-9 relative. The loss comes
# back in bf16, so it is only known to within half an ulp (2^-8 relative), and the bf16 forward
# itself is a few such roundings away from fp32: 2^-7 relative bounds the loss difference
# (measured: at most 2.6e-3). Gradients at step 0 (equal weights) pass through a handful of
# bf16 roundings (weights, activations, the gradient itself) of 2^-9..2^-8 each; 2^-5 of the
# largest entry bounds them (measured: at most 9.2e-3).
BF16_LOSS_REL = 2.0**-7
BF16_GRAD_REL = 2.0**-5


@pytest.mark.parametrize(
    "world_size,name",
    [
        (2, "mlp_bf16_stage1"),
        (2, "mlp_bf16_stage2"),
        (2, "mlp_bf16_stage3"),
        (2, "gpt_bf16"),
        (4, "mlp_bf16_stage3"),
        (4, "hybrid_bf16_accum"),
    ],
)
def test_bf16_mixed_precision_tracks_the_fp32_reference(runs, world_size, name):
    for r in _case(runs, world_size, name):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=BF16_LOSS_REL)
        assert r["grad_rel_err"] < BF16_GRAD_REL
        assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"]  # fp32 masters


def test_fp16_dynamic_loss_scaling_skips_backs_off_and_grows(runs):
    for r in _case(runs, 2, "fp16_loss_scaling"):
        history = r["history"]
        assert r["param_dtypes"] == ["torch.float32"]
        assert all(h["finite"] for h in history)
        assert not history[0]["moved"]  # 2^24 overflows fp16: the first step is skipped...
        good_run = 0
        for h in history:
            if not h["moved"]:  # ...and every skipped step halves the scale
                assert h["next_scale"] == h["scale"] / 2
                good_run = 0
            else:
                good_run += 1
                # loss_scale_window=2: the scale doubles after every second good step in a row
                assert h["next_scale"] == (h["scale"] * 2 if good_run % 2 == 0 else h["scale"])
        assert sum(h["moved"] for h in history) >= 4
        assert any(h["next_scale"] > h["scale"] for h in history)


def test_a_fused_optimizers_overflow_is_skipped_on_every_rank(runs):
    """An inf in one rank's shard only, the first gradient a replicated one: scaler.step on a
    fused AdamW without unscale_ first checked each rank's own gradients there (DTensor agreed
    the flag by the first gradient's placement), so rank 0 stepped and kept its scale while rank 1
    skipped and halved: the whole weight's copies and the scales parted for good. Every rank
    skips now and halves alike, with or without unscale_ first."""
    per_rank = _case(runs, 2, "fused_overflow_agreement")
    for way in ("unscale=False", "unscale=True"):
        got = [r[way] for r in per_rank]
        assert got[0]["replicated"] == [True, False], got  # the whole weight's gradient first
        assert [g["stepped"] for g in got] == [0, 0], (way, got)
        assert [g["scale"] for g in got] == [2.0**15, 2.0**15], (way, got)


# --- checkpoints -----------------------------------------------------------------------------


def test_resume_continues_the_exact_loss_trajectory(runs):
    for r in _case(runs, 4, "checkpoint_source"):
        assert r["extra"] == {"step": 3}
        assert r["resumed"] == pytest.approx(r["uninterrupted"], rel=1e-6)


def test_checkpoint_saved_at_4_ranks_loads_at_2_into_stage_3_and_stage_2(runs):
    expected = _case(runs, 4, "checkpoint_source")[0]["uninterrupted"]
    for r in _case(runs, 2, "checkpoint_reshard"):
        assert r["stage3"] == pytest.approx(expected, rel=1e-5)
        assert r["stage2"] == pytest.approx(expected, rel=1e-5)


def test_experts_checkpoint_reshards_between_split_dims(runs):
    """Saved at 4 ranks with the stacked experts split along dim 1, loaded at 2 (split along dim
    0) into stages 3 and 2: the same trajectory."""
    source = _case(runs, 4, "experts_checkpoint_source")
    for r in source:
        assert r["resumed"] == pytest.approx(r["uninterrupted"], rel=1e-6)
    for r in _case(runs, 2, "experts_checkpoint_reshard"):
        assert r["stage3"] == pytest.approx(source[0]["uninterrupted"], rel=1e-5)
        assert r["stage2"] == pytest.approx(source[0]["uninterrupted"], rel=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_weights_with_fewer_rows_than_ranks_split_along_another_dim(runs, stage):
    """zerofx/ir/layout.py, NOTE: the sharded dim. At 4 ranks the [2, 12, 8] and [2, 8, 12]
    experts and the [2, 8] router split along dim 1 into equal parts (by rows, ranks 0 and 1
    would hold a whole expert each and ranks 2 and 3 nothing); at 2 ranks they have enough rows
    and split along dim 0, while the [1, 2] router bias splits along dim 1. A [4, 8] head stays
    on dim 0."""
    expect = {
        4: {
            "w_in": ("(Shard(dim=1),)", [2, 3, 8]),
            "w_out": ("(Shard(dim=1),)", [2, 2, 12]),
            "router.weight": ("(Shard(dim=1),)", [2, 2]),
            "head.weight": ("(Shard(dim=0),)", [1, 8]),
        },
        2: {
            "w_in": ("(Shard(dim=0),)", [1, 12, 8]),
            "router_bias": ("(Shard(dim=1),)", [1, 1]),
            "head.weight": ("(Shard(dim=0),)", [2, 8]),
        },
    }
    for world_size, layouts in expect.items():
        for r in _case(runs, world_size, f"experts_stage{stage}"):
            for name, layout in layouts.items():
                assert tuple(r["layout"][name]) == layout, name


def test_export_writes_one_consolidated_state_dict_plain_models_load(runs, folder, tmp_path):
    import zerofx.checkpoint

    saved = _case(runs, 4, "checkpoint_source")[0]["saved"]
    out = tmp_path / "model.pt"
    zerofx.checkpoint.export_full_state_dict(folder / "ckpt", out)
    plain = UnevenNet()
    plain.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, full shapes
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, torch.tensor(saved[key]), rtol=0, atol=0)


def test_flat_buckets_are_runs_of_one_key_within_the_byte_cap(monkeypatch):
    from zerofx.runtime import eager_buckets as flat

    monkeypatch.setattr(flat, "BUCKET_BYTES", 100)
    items = list(enumerate([("g", 40), ("g", 40), ("g", 40), ("h", 10), ("h", 200), ("h", 10), ("g", 10)]))
    buckets = [[i for i, _ in b] for b in flat._buckets(items, lambda it: it[1][0], lambda it: it[1][1])]
    # 40+40 fits, a third 40 does not; a key change closes a bucket; an item over the cap travels alone
    assert buckets == [[0, 1], [2], [3], [4], [5], [6]]
