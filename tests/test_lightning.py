"""zerofx under PyTorch Lightning (zerofx.lightning.ZeroFXStrategy), on torchrun-launched gloo ranks."""

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
    Inside an accumulation window the backward ran no reduce-scatter (the strategy's no_sync);
    the window's last one ran them. The resumed run's first loss is exactly the first run's on
    the same rows: the loaded parameters are the saved ones, bit for bit."""
    from zerofx.launch import local_ranks

    want = ls.fit_and_resume(str(tmp_path / "plain"), 2)
    per_rank = local_ranks(ls.fit_and_resume, 2, str(tmp_path / "zerofx"), 2, name="lightning")
    _assert_trains_like([r["first"] for r in per_rank], want["first"], "first run")
    _assert_trains_like([r["resumed"] for r in per_rank], want["resumed"], "resumed run")
    epoch = len(want["first"]["losses"]) // 2
    for rank, r in enumerate(per_rank):
        first = r["first"]
        windows = [first["reduces"][a:b] for a, b in zip([0, *first["steps"]], first["steps"])]
        assert all(w[:-1] == [0] * (len(w) - 1) and w[-1] > 0 for w in windows), (rank, first["reduces"])
        assert r["resumed"]["losses"][0] == first["losses"][epoch], rank


def test_zerofx_strategy_refuses_what_would_not_train(tmp_path):
    """A LightningModule whose configure_model shards nothing, and a precision that converts the
    parameters under zerofx's shards: errors naming the fix, before any step."""
    from zerofx.launch import local_ranks
    from zerofx.lightning import ZeroFXStrategy

    with pytest.raises(ZeroFXError, match="tensor_parallel_size must be a positive int"):
        ZeroFXStrategy(tensor_parallel_size=0)
    (got,) = local_ranks(ls.refusals, 1, str(tmp_path), name="lightning-refusals")
    assert "no module of the LightningModule is sharded by zerofx" in got["unsharded"], got
    assert "precision='bf16-true' converts the model's parameters" in got["bf16-true"], got
