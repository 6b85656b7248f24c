"""zerofx under PyTorch Lightning: the Trainer (ZeroFXStrategy) and Fabric (ZeroFXFabricStrategy),
on torchrun-launched gloo ranks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning", reason="the lightning extra: pip install 'zerofx[lightning]'")

from tests import lightning_scenarios as ls  # noqa: E402
from zerofx import ZeroFXError  # noqa: E402


def _assert_trains_like(got: list[dict], want: dict, what: str) -> None:
    """The ranks' mean loss per micro-batch within 1e-6 relative of the one-process run (another
    summation order), optimizer steps after the same micro-batches, parameters within 1e-5."""
    assert [r["steps"] for r in got] == [want["steps"]] * len(got), (what, [r["steps"] for r in got], want["steps"])
    assert [len(r["losses"]) for r in got] == [len(want["losses"])] * len(got), what
    for j, w in enumerate(want["losses"]):
        mean = sum(r["losses"][j] for r in got) / len(got)
        assert abs(mean - w) <= 1e-6 * w, (what, j, mean, w)
    for rank, r in enumerate(got):
        for k, v in want["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=0, atol=1e-5, msg=f"{what}, rank {rank}: {k}")


def test_lightning_trainer_trains_and_resumes_like_plain_lightning(tmp_path):
    """Lightning's Trainer with ZeroFXStrategy on 2 ranks against plain Lightning in one process on
    the whole micro-batches: 4 steps of 2 accumulated micro-batches, gradients clipped, a
    checkpoint at each epoch's end (Lightning's, through DCP), then a fresh module and Trainer
    resumed from the first one. Both runs train alike (_assert_trains_like), the resumed one
    included: a lost AdamW moment would move its later losses far past rounding. (Lightning
    itself resumes such a checkpoint one micro-batch off its accumulation window: both runs do.)
    trainer.validate on the trained module (Lightning calls configure_model, so zerofx.compile, and
    moves the module to its device again) gives plain Lightning's validation loss to rounding.
    Inside an accumulation window the backward ran no reduce-scatter (the strategy's no_sync);
    the window's last one ran them. The resumed run's first loss is exactly the first run's on
    the same rows: the loaded parameters are the saved ones, bit for bit."""
    from zerofx.launch import local_ranks

    want = ls.fit_and_resume(str(tmp_path / "plain"), 2)
    per_rank = local_ranks(ls.fit_and_resume, 2, str(tmp_path / "zerofx"), 2, name="lightning")
    _assert_trains_like([r["first"] for r in per_rank], want["first"], "first run")
    _assert_trains_like([r["resumed"] for r in per_rank], want["resumed"], "resumed run")
    for rank, r in enumerate(per_rank):  # trainer.validate after fit: configure_model and .to() again
        assert abs(r["val_loss"] - want["val_loss"]) <= 1e-6 * want["val_loss"], (rank, r["val_loss"], want["val_loss"])
    epoch = len(want["first"]["losses"]) // 2
    for rank, r in enumerate(per_rank):
        first = r["first"]
        windows = [first["reduces"][a:b] for a, b in zip([0, *first["steps"]], first["steps"])]
        assert all(w[:-1] == [0] * (len(w) - 1) and w[-1] > 0 for w in windows), (rank, first["reduces"])
        assert r["resumed"]["losses"][0] == first["losses"][epoch], rank


def test_fabric_loop_trains_like_the_plain_loop_and_resumes_exactly(tmp_path):
    """A Fabric loop under ZeroFXFabricStrategy (zerofx.compile in fabric.setup_module) on 2
    ranks, 4 steps of 2 accumulated micro-batches under fabric.no_backward_sync, clipped: the
    ranks' mean losses match the plain loop in one process on the whole micro-batches within
    1e-6 relative and the parameters within 1e-5; only each window's last micro-batch reduces.
    A new model and optimizer that fabric.load the checkpoint fabric.save wrote after step 2 run
    steps 3-4 with the same losses and end with the same parameters, bit for bit."""
    from zerofx.launch import local_ranks

    want = ls.fabric_reference()
    per_rank = local_ranks(ls.fabric_loop, 2, str(tmp_path), name="fabric")
    for j, w in enumerate(want["losses"]):
        mean = sum(r["first"]["losses"][j] for r in per_rank) / 2
        assert abs(mean - w) <= 1e-6 * w, (j, mean, w)
    half = len(want["losses"]) // 2
    for rank, r in enumerate(per_rank):
        first, resumed = r["first"], r["resumed"]
        assert first["reduces"][0::2] == [0] * ls.STEPS and all(n > 0 for n in first["reduces"][1::2]), rank
        for k, v in want["params"].items():
            torch.testing.assert_close(first["params"][k], v, rtol=0, atol=1e-5, msg=f"rank {rank}: {k}")
        assert resumed["losses"] == first["losses"][half:], (rank, resumed["losses"], first["losses"])
        assert [k for k in first["params"] if not torch.equal(resumed["params"][k], first["params"][k])] == [], rank


def test_lightning_loops_see_what_callbacks_write_and_scale_fp16_losses(tmp_path):
    """On 2 ranks against plain Lightning in one process (tests/lightning_scenarios.loop_edges):
    EMAWeightAveraging at stage 2 validates on the averaged weights (the sanity check, each
    epoch's end, and trainer.validate after fit: the mean loss over the ranks within 1e-6 of
    plain's). The callback writes them through param.data, which stage 2's whole copies did not
    see: validation read the training weights, silently. A model compiled with
    param_dtype=float16 and loss_scale="dynamic" trains with zerofx's scaler: a loss scaled by 1e-4
    (SGD's rate by 1e4) moves every parameter as fp32 does, within 5%, under the Trainer and in a
    Fabric loop (nothing scaled that loss
    before, so its fp16 gradients underflowed and most parameters never moved). Refused at setup:
    a trainable parameter outside the compiled model (each rank would train its own), Lightning's
    StochasticWeightAveraging, EMA with checkpoints (Lightning pickles its sharded state: the first
    checkpoint failed), and a precision plugin beside zerofx's loss scaling. Fabric at stage 2:
    fabric.load of a sharded checkpoint restores a OneCycleLR (Lightning's sharded path had put
    the saved state dict in the scheduler's place: the resumed rate was the first step's, as under
    FSDP2), and after fabric.load_raw the model computes with the loaded weights (the first
    forward had raised: load_raw's per-submodule writes left stage 2's whole copies stale)."""
    from zerofx.launch import local_ranks

    want = ls.loop_edges(str(tmp_path / "plain"), 2)
    per_rank = local_ranks(ls.loop_edges, 2, str(tmp_path / "zerofx"), 2, name="lightning-edges")
    assert len(want["ema_val"]) == 3 and len(want["ema_validate"]) == 1, want  # sanity check + 2 epochs; validate
    for rank, got in enumerate(per_rank):
        for key in ("ema_val", "ema_validate"):
            assert len(got[key]) == len(want[key]), (rank, key, got[key], want[key])
            for g, w in zip(got[key], want[key]):
                assert abs(g - w) <= 1e-6 * w, (rank, key, got[key], want[key])
        assert got["scale"] == 2.0**12, got["scale"]  # no overflow: every step taken
        # validate on the Trainer that fitted (its precision plugin is zerofx's already): fp16's loss
        assert abs(got["fp16_val"] - want["fp16_val"]) <= 1e-2 * want["fp16_val"], (got["fp16_val"], want["fp16_val"])
        for key in ("moved", "fabric_moved"):
            for k, w in want[key].items():
                assert w > 0 and abs(got[key][k] - w) <= 0.05 * w, (rank, key, k, got[key][k], w)
        assert "temperature is trainable but outside every module zerofx compiled" in got["outside"], got["outside"]
        assert "StochasticWeightAveraging copies the module before configure_model" in got["swa"], got["swa"]
        assert "Train it with enable_checkpointing=False" in got["ema_checkpoints"], got["ema_checkpoints"]
        assert "precision='bf16-mixed' with a model zerofx compiled with loss_scale='dynamic'" in got["fp16_precision"]
        loads = got["fabric_loads"]  # stage 2: the scheduler restored, whole copies refreshed after load_raw
        assert isinstance(loads["sched"], dict) and loads["sched"]["loaded"] == loads["sched"]["saved"], loads
        assert loads["sched"]["saved"][0] == 2, loads
        assert isinstance(loads["load_raw"], dict), loads["load_raw"]
        assert abs(loads["load_raw"]["loaded"] - loads["load_raw"]["want"]) <= 1e-5 * loads["load_raw"]["want"], loads


def test_one_rank_checkpoints_save_and_resume(tmp_path):
    """devices=1: zerofx keeps a one-rank model's parameters whole (no DTensors), which Lightning's
    checkpoint code took for a model with nothing to save: Fabric could neither save nor load, and
    the Trainer could not resume from its own checkpoint. Now both run the multi-rank tests'
    loops on one rank: the Trainer resumed from its epoch-0 checkpoint starts with the first run's
    loss on the same rows, exactly (the rows rank 0 of 2 would see: an epoch of two steps);
    Fabric's loaded model and optimizer run steps 3-4 as the first run did, bit for bit."""
    from zerofx.launch import local_ranks

    (trainer,) = local_ranks(ls.fit_and_resume, 1, str(tmp_path / "trainer"), 2, name="lightning-one")
    first, resumed = trainer["first"]["losses"], trainer["resumed"]["losses"]
    assert len(first) == 2 * ls.STEPS and resumed and resumed[0] == first[len(first) // 2], (first, resumed)
    (fabric,) = local_ranks(ls.fabric_loop, 1, str(tmp_path / "fabric"), name="fabric-one")
    first, resumed = fabric["first"], fabric["resumed"]
    assert resumed["losses"] == first["losses"][len(first["losses"]) // 2 :], (resumed["losses"], first["losses"])
    assert all(torch.equal(resumed["params"][k], v) for k, v in first["params"].items())


def test_zerofx_strategy_refuses_what_would_not_train(tmp_path):
    """A LightningModule whose configure_model shards nothing, a precision that converts the
    parameters under zerofx's shards, a Fabric parallelize_fn that shards nothing: errors naming
    the fix, before any step."""
    from zerofx.launch import local_ranks
    from zerofx.lightning import ZeroFXFabricStrategy, ZeroFXStrategy

    with pytest.raises(ZeroFXError, match="tensor_parallel_size must be a positive int"):
        ZeroFXStrategy(tensor_parallel_size=0)
    with pytest.raises(ZeroFXError, match="options= are for the default parallelize_fn"):
        ZeroFXFabricStrategy(lambda module, mesh: module, options={"stage": 2})
    (got,) = local_ranks(ls.refusals, 1, str(tmp_path), name="lightning-refusals")
    assert "no module of the LightningModule is sharded by zerofx" in got["unsharded"], got
    assert "precision='bf16-true' converts the model's parameters" in got["bf16-true"], got
    assert "parallelize_fn sharded no module with zerofx" in got["fabric"], got
