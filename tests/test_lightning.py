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
