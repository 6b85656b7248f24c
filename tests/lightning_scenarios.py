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

    def __init__(self, shard: bool, **options) -> None:
        super().__init__()
        self.model = gpt()
        self.shard = shard
        self.options = options  # zerofx.compile's
        self.losses: list[float] = []
        self.val_losses: list[float] = []  # the mean over the ranks, per validation batch
        self.reduces: list[int] = []
        self.steps: list[int] = []
        self.comm = zerofx.CollectiveCounter()

    def configure_model(self) -> None:
        if self.shard:
            zerofx.compile(self.model, self.device_mesh["data_parallel"], **self.options)

    def training_step(self, rows: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.model(rows[:, :-1], rows[:, 1:])
        self.losses.append(loss.item())
        return loss

    def validation_step(self, rows: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.model(rows[:, :-1], rows[:, 1:])
        self.log("val_loss", loss, sync_dist=True)  # the mean over the ranks
        self.val_losses.append(self.all_gather(loss.detach()).float().mean().item())
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

    @staticmethod
    def record_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter whole (gathered: a collective), by state_dict key."""
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()
        }

    def record(self) -> dict:
        return {
            "losses": self.losses,
            "reduces": self.reduces,
            "steps": self.steps,
            "params": self.record_params(self.model),
        }


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
    of each epoch, and trainer.validate on the trained module; then a new module and Trainer
    resumed from the checkpoint after epoch 0. On a
    rank of a torchrun-launched job under ZeroFXStrategy when WORLD_SIZE is set, else plain
    Lightning in this process."""
    sharded = "WORLD_SIZE" in os.environ
    ends = ModelCheckpoint(dirpath=f"{out}/ckpt", filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True)
    first = LitGPT(sharded)
    trainer = _trainer(f"{out}/first", sharded, callbacks=[ends])
    trainer.fit(first, _loader(sharded, world))
    # a second entry point on the trained module: Lightning calls configure_model (zerofx.compile
    # again, on a new mesh) and moves the module to its device again
    (validated,) = trainer.validate(first, _loader(sharded, world), verbose=False)
    resumed = LitGPT(sharded)
    _trainer(f"{out}/resumed", sharded).fit(resumed, _loader(sharded, world), ckpt_path=f"{out}/ckpt/epoch=0.ckpt")
    return {"first": first.record(), "resumed": resumed.record(), "val_loss": validated["val_loss"]}


def refusals(out: str) -> dict:
    """On one torchrun-launched rank: what fit raises for a module whose configure_model shards
    nothing and for a precision that converts the parameters, and what Fabric's setup_module
    raises for a parallelize_fn that shards nothing."""
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

    from zerofx.lightning import ZeroFXFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroFXFabricStrategy(lambda module, mesh: module))
    fabric.launch()
    try:
        fabric.setup_module(gpt())
        fabric_error = "set up"
    except ZeroFXError as e:
        fabric_error = str(e)
    return {
        "unsharded": error(LitGPT(shard=False)),
        "bf16-true": error(LitGPT(shard=True), precision="bf16-true"),
        "fabric": fabric_error,
    }


def _fabric_steps(fabric, model, opt, first_step: int, last_step: int, record: dict) -> None:
    """Optimizer steps first_step..last_step-1 of a Fabric loop: ACCUMULATION micro-batches each
    (this rank's PER_RANK rows of every micro-batch), the window's earlier ones under
    fabric.no_backward_sync, gradients clipped to CLIP."""
    data, world, rank = Tokens(), fabric.world_size, fabric.global_rank
    for step in range(first_step, last_step):
        for k in range(ACCUMULATION):
            micro = step * ACCUMULATION + k
            start = (micro * PER_RANK * world + rank * PER_RANK) % ROWS
            rows = torch.stack([data[start + i] for i in range(PER_RANK)])
            with fabric.no_backward_sync(model, enabled=k < ACCUMULATION - 1):
                with zerofx.CollectiveCounter() as comm:
                    loss = model(rows[:, :-1], rows[:, 1:])
                    fabric.backward(loss / ACCUMULATION)
            record["losses"].append(loss.item())
            record["reduces"].append(comm.calls["reduce_scatter"])
        fabric.clip_gradients(model, opt, max_norm=CLIP)
        opt.step()
        opt.zero_grad()


def fabric_loop(out: str) -> dict:
    """One rank of a torchrun-launched job: a Fabric loop under ZeroFXFabricStrategy, STEPS
    steps with fabric.save after half of them; then a new model and optimizer that fabric.load
    that checkpoint and run the second half again."""
    from zerofx.lightning import ZeroFXFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=ZeroFXFabricStrategy())
    fabric.launch()

    def setup():
        model = fabric.setup_module(gpt())
        return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))

    model, opt = setup()
    first: dict = {"losses": [], "reduces": []}
    _fabric_steps(fabric, model, opt, 0, STEPS // 2, first)
    fabric.save(f"{out}/half", {"model": model, "optimizer": opt})
    _fabric_steps(fabric, model, opt, STEPS // 2, STEPS, first)
    first["params"] = LitGPT.record_params(model)

    model, opt = setup()
    fabric.load(f"{out}/half", {"model": model, "optimizer": opt})
    resumed: dict = {"losses": [], "reduces": []}
    _fabric_steps(fabric, model, opt, STEPS // 2, STEPS, resumed)
    resumed["params"] = LitGPT.record_params(model)
    return {"first": first, "resumed": resumed}


def fabric_reference() -> dict:
    """The Fabric loop's arithmetic in one process on the whole micro-batches (2 ranks' rows)."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data, per_micro, losses = Tokens(), PER_RANK * 2, []
    for micro in range(STEPS * ACCUMULATION):
        rows = torch.stack([data[(micro * per_micro + i) % ROWS] for i in range(per_micro)])
        loss = model(rows[:, :-1], rows[:, 1:])
        losses.append(loss.item())
        (loss / ACCUMULATION).backward()
        if (micro + 1) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "params": LitGPT.record_params(model)}


class _ScaledDown(LitGPT):
    """A loss scaled by 1e-4 and SGD's rate by 1e4: the same steps as the loss itself in fp32,
    while in fp16 gradients that small (about 1e-7) underflow unless the loss is scaled up for the
    backward (by 2^12 here: 2^16, DeepSpeed's initial scale, overflows this model's first fp16
    backward, a skipped step, as DeepSpeed's first steps often are)."""

    def training_step(self, rows: torch.Tensor, index: int) -> torch.Tensor:
        return super().training_step(rows, index) * 1e-4

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1 / 1e-4)


def _fabric_fp16(sharded: bool, world: int, options: dict) -> dict[str, float]:
    """Two clipped SGD steps of a Fabric loop on _ScaledDown's loss and rate, under
    ZeroFXFabricStrategy(options=options) on this rank's rows (in one process without Fabric
    on every rank's): how far each parameter moved."""
    from zerofx.lightning import ZeroFXFabricStrategy

    if sharded:
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ZeroFXFabricStrategy(options=options))
        fabric.launch()
        model = fabric.setup_module(gpt())
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1 / 1e-4))
        rank = fabric.global_rank
    else:
        model, rank = gpt(), 0
        opt = torch.optim.SGD(model.parameters(), lr=0.1 / 1e-4)
    before = LitGPT.record_params(model)
    data, rows_per = Tokens(), PER_RANK if sharded else PER_RANK * world
    for step in range(2):
        start = step * PER_RANK * world + rank * rows_per
        rows = torch.stack([data[start + i] for i in range(rows_per)])
        loss = model(rows[:, :-1], rows[:, 1:]) * 1e-4
        if sharded:
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=CLIP)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    after = LitGPT.record_params(model)
    return {k: (after[k].float() - before[k].float()).abs().max().item() for k in before}


def _fabric_loads(out: str, world: int) -> dict:
    """What Fabric's loads leave a stage-2 zerofx model and a scheduler with: fabric.load of a
    sharded checkpoint's OneCycleLR (its step count and rate, against the saved one's), and
    fabric.load_raw of a whole state dict torch.save wrote (the loaded model's loss on this rank's
    rows, against the same weights' in one process), or the error either raised."""
    from zerofx.lightning import ZeroFXFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ZeroFXFabricStrategy(options={"stage": 2}))
    fabric.launch()
    rows = torch.stack([Tokens()[fabric.global_rank * PER_RANK + i] for i in range(PER_RANK)])

    def setup():
        model = fabric.setup_module(gpt())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=10)

    got = {}
    model, opt, sched = setup()
    for _ in range(2):
        fabric.backward(model(rows[:, :-1], rows[:, 1:]))
        opt.step()
        opt.zero_grad()
        sched.step()
    fabric.save(f"{out}/sched", {"model": model, "optimizer": opt, "sched": sched})
    saved = (sched.last_epoch, sched.get_last_lr())
    model, opt, sched = setup()
    try:
        fabric.load(f"{out}/sched", {"model": model, "optimizer": opt, "sched": sched})
        got["sched"] = {"loaded": (sched.last_epoch, sched.get_last_lr()), "saved": saved}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        got["sched"] = f"{type(e).__name__}: {e}"
    torch.manual_seed(1)
    from zerofx.models import GPT, GPTConfig

    other = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=32))
    if fabric.global_rank == 0:
        torch.save(other.state_dict(), f"{out}/raw.pt")
    fabric.barrier()
    try:
        fabric.load_raw(f"{out}/raw.pt", model)
        with torch.no_grad():
            got["load_raw"] = {"loaded": model(rows[:, :-1], rows[:, 1:]).item()}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        got["load_raw"] = f"{type(e).__name__}: {e}"
    else:
        with torch.no_grad():
            got["load_raw"]["want"] = other(rows[:, :-1], rows[:, 1:]).item()
    return got


def loop_edges(out: str, world: int) -> dict:
    """Lightning's loops where zerofx's state needs the strategy's help, on the ranks of a
    torchrun-launched job under ZeroFXStrategy (plain Lightning in one process when WORLD_SIZE is
    not set): EMAWeightAveraging at stage 2 (validation on the averaged weights, which the callback
    writes through param.data), and fp16 with zerofx's loss scaler (param_dtype=float16) against
    fp32, in the Trainer and in a Fabric loop. On the ranks also what setup refuses: trainable parameters outside the compiled model,
    StochasticWeightAveraging, a precision plugin beside zerofx's loss scaling; and what Fabric's
    loads leave a stage-2 model and a scheduler with (_fabric_loads)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging

    from zerofx.errors import ZeroFXError

    sharded = "WORLD_SIZE" in os.environ
    ema = LitGPT(sharded, stage=2)
    trainer = _trainer(
        f"{out}/ema",
        sharded,
        callbacks=[EMAWeightAveraging(decay=0.5)],
        limit_val_batches=1,
        enable_checkpointing=False,
    )
    trainer.fit(ema, _loader(sharded, world), _loader(sharded, world))
    during_fit = list(ema.val_losses)
    trainer.validate(ema, _loader(sharded, world), verbose=False)  # the average, copied over at the end of fit
    fp16 = {"param_dtype": torch.float16, "loss_scale": "dynamic", "initial_loss_scale": 2.0**12} if sharded else {}
    scaled = _ScaledDown(sharded, **fp16)
    before = LitGPT.record_params(scaled.model)
    trainer = _trainer(f"{out}/fp16", sharded)
    trainer.fit(scaled, _loader(sharded, world))
    after = LitGPT.record_params(scaled.model)
    (validated,) = trainer.validate(scaled, _loader(sharded, world), verbose=False)  # the same Trainer again
    got = {
        "scale": zerofx.loss_scaler(scaled.model).get_scale() if sharded else None,  # (no step skipped)
        "ema_val": during_fit,
        "ema_validate": ema.val_losses[len(during_fit) :],
        "moved": {k: (after[k].float() - before[k].float()).abs().max().item() for k in before},
        "fp16_val": validated["val_loss"],
    }
    got["fabric_moved"] = _fabric_fp16(sharded, world, fp16)
    if not sharded:
        return got

    def refused(module: LitGPT, **extra) -> str:
        try:
            _trainer(f"{out}/refused", sharded, **extra).fit(module, _loader(sharded, world))
        except ZeroFXError as e:
            return str(e)
        return "trained"

    got["fabric_loads"] = _fabric_loads(out, world)
    outside = LitGPT(sharded)
    outside.temperature = torch.nn.Parameter(torch.ones(()))
    got["outside"] = refused(outside)
    got["swa"] = refused(LitGPT(sharded), callbacks=[StochasticWeightAveraging(swa_lrs=1e-3)])
    got["ema_checkpoints"] = refused(LitGPT(sharded), callbacks=[EMAWeightAveraging()])  # (checkpointing on)
    got["fp16_precision"] = refused(_ScaledDown(sharded, **fp16), precision="bf16-mixed")
    return got
