"""``zerofx demo``: train a small GPT with ZeRO (stage 3 by default) on local gloo ranks and
show what it costs.

The ranks are started with torchrun's own machinery (``zerofx.launch.local_ranks``), exactly
as ``torchrun --standalone --nproc-per-node N`` would, so nothing here is a home-made launcher.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 2
    steps: int = 20
    batch: int = 4  # sequences per rank
    seq_len: int = 64
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    vocab: int = 256
    lr: float = 1e-2
    dataset_size: int = 16
    dump_dir: str | None = None
    stage: int = 3
    param_dtype: str | None = None  # "bf16" for bf16 compute from fp32 master shards


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _rank_main(cfg: DemoConfig) -> dict:
    import zerofx
    from zerofx.models import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        gcfg = GPTConfig(
            vocab_size=cfg.vocab, seq_len=cfg.seq_len, n_layer=cfg.layers, n_head=cfg.heads, d_model=cfg.d_model
        )
        torch.manual_seed(0)
        model = GPT(gcfg)
        unsharded = [p for p in model.parameters()]
        psi = sum(p.numel() * p.element_size() for p in unsharded)
        # params + grads + AdamW's two moments, all fp32
        unsharded_state = psi * 4
        options = {"dump_dir": cfg.dump_dir} if cfg.dump_dir else {}
        options.update(stage=cfg.stage, param_dtype=cfg.param_dtype)
        model = zerofx.compile(model, mesh, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        # a fixed set of random token sequences: random data, yet learnable (memorized), so the
        # loss visibly falls; each rank draws its own batches from it
        data_gen = torch.Generator().manual_seed(1000)
        dataset = torch.randint(0, cfg.vocab, (cfg.dataset_size, cfg.seq_len + 1), generator=data_gen)
        gen = torch.Generator().manual_seed(2000 + rank)
        say = print if rank == 0 else (lambda *a, **k: None)
        say(
            f"zerofx demo: GPT {cfg.layers} layers, d_model {cfg.d_model}, {sum(p.numel() for p in unsharded):,} "
            f"parameters ({_mb(psi)}), ZeRO-{cfg.stage}{' with ' + cfg.param_dtype + ' compute' if cfg.param_dtype else ''} "
            f"over {world} gloo ranks, {cfg.steps} AdamW steps"
        )
        say(f"{'step':>9} {'loss':>8} {'time':>9} {'all-gather':>12} {'reduce-scatter':>15}")
        comm_per_step = {}
        started = time.perf_counter()
        for step in range(cfg.steps):
            rows = dataset[torch.randint(0, cfg.dataset_size, (cfg.batch,), generator=gen)]
            tokens, targets = rows[:, :-1], rows[:, 1:]
            t0 = time.perf_counter()
            with zerofx.CollectiveCounter() as comm:  # stages 1-2 all-gather after the step
                loss = model(tokens, targets)
                loss.backward()
                opt.step()
            if step == cfg.steps - 1:
                state = zerofx.model_state_bytes(model, opt)  # grads still held: the step's peak
            opt.zero_grad()
            elapsed = time.perf_counter() - t0
            mean_loss = loss.detach().float()
            dist.all_reduce(mean_loss)
            comm_per_step = dict(comm.bytes)
            say(
                f"{step + 1:>4}/{cfg.steps:<4} {mean_loss.item() / world:8.4f} {elapsed * 1e3:7.0f}ms "
                f"{_mb(comm.bytes['all_gather']):>12} {_mb(comm.bytes['reduce_scatter']):>15}",
                flush=True,
            )
        # tensors, not all_gather_object: object collectives need NumPy, which zerofx does not
        mine = torch.tensor([state.params, state.grads, state.optimizer, state.total], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        per_rank = [dict(zip(("params", "grads", "optimizer", "total"), t.tolist())) for t in gathered]
        total_time = time.perf_counter() - started
        share = (world - 1) / world
        if rank == 0:
            print(f"\nmodel state per rank (params + grads + AdamW state), unsharded total {_mb(unsharded_state)}:")
            for r, s in enumerate(per_rank):
                print(
                    f"  rank {r}: {_mb(s['total'])} = {s['total'] / unsharded_state:.1%} of unsharded "
                    f"(params {_mb(s['params'])}, grads {_mb(s['grads'])}, optimizer {_mb(s['optimizer'])})"
                )
            moved = sum(comm_per_step.values())
            if cfg.stage == 3:
                bound = (
                    f"ZeRO-3 bound 3·Ψ·(N-1)/N = {_mb(3 * psi * share)}; the backward re-gathers only the "
                    "parameters it reads"
                )
            else:
                bound = f"ZeRO-{cfg.stage}: 2·Ψ·(N-1)/N = {_mb(2 * psi * share)}"
            if cfg.param_dtype:
                bound += f"; all-gathers move {cfg.param_dtype}"
            print(f"collective bytes per step per rank: {_mb(moved)} ({bound})")
            print(f"{cfg.steps} steps in {total_time:.1f}s (first step includes compilation)")
        return {"state": per_rank[rank], "comm": comm_per_step, "psi": psi}
    finally:
        dist.destroy_process_group()


def run_demo(cfg: DemoConfig) -> dict:
    """Start ``cfg.world_size`` local ranks with torchrun's launcher and train; returns rank 0's stats."""
    from zerofx.launch import local_ranks

    return local_ranks(_rank_main, cfg.world_size, cfg, name="zerofx-demo")[0]
