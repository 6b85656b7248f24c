"""Rank side of tests/test_lightning.py: a small GPT in a LightningModule, trained by Lightning's
Trainer under zerofx.lightning.ZeroFXStrategy on torchrun-launched gloo ranks, and the same
module trained by plain Lightning in one process as the reference."""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import zerofx

VOCAB, SEQ = 64, 16
PER_RANK = 2  # sequences per rank per micro-batch
ACCUMULATION = 2
STEPS = 4  # optimizer steps
ROWS = 16  # dataset size: an epoch is 2 optimizer steps at 2 ranks (a checkpoint at its end)
LR, CLIP = 1e-2, 1.0


def gpt():
    from zerofx.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32))


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))


class LitGPT(L.LightningModule):
    """Records per micro-batch this rank's loss and the reduce-scatters its backward ran, and
    after how many micro-batches each optimizer step came."""

    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.model = gpt()
        self.shard = shard
        self.losses: list[float] = []
        self.reduces: list[int] = []
        self.steps: list[int] = []
        self.comm = zerofx.CollectiveCounter()

    def configure_model(self) -> None:
        if self.shard:
            zerofx.compile(self.model, self.device_mesh["data_parallel"])

    def training_step(self, rows: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.model(rows[:, :-1], rows[:, 1:])
        self.losses.append(loss.item())
        return loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.comm.__enter__()
        self._before = self.comm.calls["reduce_scatter"]

    def on_after_backward(self) -> None:
        self.reduces.append(self.comm.calls["reduce_scatter"] - self._before)
        self.comm.__exit__(None, None, None)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.steps.append(len(self.losses))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def record(self) -> dict:
        params = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in self.model.state_dict().items()
        }
        return {"losses": self.losses, "reduces": self.reduces, "steps": self.steps, "params": params}


def _trainer(out: str, sharded: bool, **extra) -> L.Trainer:
    from zerofx.lightning import ZeroFXStrategy

    placement = {"devices": int(os.environ["LOCAL_WORLD_SIZE"]), "strategy": ZeroFXStrategy()} if sharded else {}
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATION,
        gradient_clip_val=CLIP,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        use_distributed_sampler=False,
        **placement,
        **extra,
    )


def _loader(sharded: bool, world: int):
    """Rows dealt round-robin to the ranks, in order (Lightning's own sampler would shuffle); in
    one process the micro-batch is every rank's rows together."""
    if not sharded:
        return torch.utils.data.DataLoader(Tokens(), batch_size=PER_RANK * world)
    rank = int(os.environ["RANK"])  # torchrun's: the process group does not exist yet
    sampler = torch.utils.data.DistributedSampler(Tokens(), num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(Tokens(), batch_size=PER_RANK, sampler=sampler)


def fit_and_resume(out: str, world: int) -> dict:
    """STEPS optimizer steps of ACCUMULATION micro-batches (two epochs), a checkpoint at the end
    of each epoch; then a new module and Trainer resumed from the checkpoint after epoch 0. On a
    rank of a torchrun-launched job under ZeroFXStrategy when WORLD_SIZE is set, else plain
    Lightning in this process."""
    sharded = "WORLD_SIZE" in os.environ
    ends = ModelCheckpoint(dirpath=f"{out}/ckpt", filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True)
    first = LitGPT(sharded)
    _trainer(f"{out}/first", sharded, callbacks=[ends]).fit(first, _loader(sharded, world))
    resumed = LitGPT(sharded)
    _trainer(f"{out}/resumed", sharded).fit(resumed, _loader(sharded, world), ckpt_path=f"{out}/ckpt/epoch=0.ckpt")
    return {"first": first.record(), "resumed": resumed.record()}


def refusals(out: str) -> dict:
    """On one torchrun-launched rank: what fit raises for a module whose configure_model shards
    nothing, and for a precision that converts the parameters."""
    from zerofx.errors import ZeroFXError
    from zerofx.lightning import ZeroFXStrategy

    def error(module: LitGPT, **extra) -> str:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ZeroFXStrategy(),
            max_steps=1,
            logger=False,
            default_root_dir=out,
            **extra,
        )
        try:
            trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=2))
        except ZeroFXError as e:
            return str(e)
        return "trained"

    return {"unsharded": error(LitGPT(shard=False)), "bf16-true": error(LitGPT(shard=True), precision="bf16-true")}
