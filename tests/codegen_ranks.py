"""Rank-side half of the multi-rank codegen tests: one spawn per world size runs all of it.

* ``train``: the GPT trained a few steps with each executor from the same seed and batches;
  returns losses, final local shards and the Triton kernel counters. The "triton" run writes
  a debug dump. On two ranks the MLP is also trained with the "inductor" executor.
* ``bucket_roundtrip``: the collective glue kernels around real gloo collectives, against the
  per-parameter path zerofx uses today (pad + all-gather / reduce-scatter "avg" + slice).

Every part reports its traceback instead of raising, so one failure does not hide the others.
"""

from __future__ import annotations

import io
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerofx
from tests.models import CASES, GPT_CFG
from tests.multirank import mean_over_ranks
from tests.parity import reference_shard
from zerofx.models import GPT, random_batch

STEPS = 4
PER_RANK = 2


def train(rank: int, world_size: int, case: str, executor: str, dump_dir: str | None) -> dict:
    from zerofx.codegen.triton_runtime import cache_info

    torch.manual_seed(0)
    model = GPT(GPT_CFG) if case == "gpt" else CASES[case].build()
    zerofx.compile(model, init_device_mesh("cpu", (world_size,)), executor=executor, dump_dir=dump_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1234)
    before = cache_info()
    losses = []
    for _ in range(STEPS):
        if case == "gpt":
            x, y = random_batch(GPT_CFG, PER_RANK * world_size, gen)
        else:
            x, y = CASES[case].batch(PER_RANK * world_size, gen)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = model(x[mine], y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    after = cache_info()
    torch._dynamo.reset()
    params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
    return dict(
        losses=losses,
        params=params,
        launches=after["launches"] - before["launches"],
        fallbacks=after["fallbacks"] - before["fallbacks"],
    )


def bucket_roundtrip(rank: int, world_size: int) -> dict:
    from zerofx.codegen.collective_kernels import (
        BucketLayout,
        average_into_shards,
        pack_grads,
        pack_shards,
        unpack_gathered,
    )

    f = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    shapes = [(7, 5), (4,), (3, 1, 3), (1, 2), (1100,)]  # uneven rows, a shard of 0 rows, several blocks
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(world_size)]  # every rank's grads
    layout = BucketLayout.of(shapes, world_size)
    shards = [reference_shard(t, rank, world_size) for t in full]

    out: dict = {}
    packed = pack_shards(shards, layout)
    gathered = f.wait_tensor(f.all_gather_into_tensor(packed, world_size, group))
    out["gathered"] = [(u, t) for u, t in zip(unpack_gathered(gathered, layout), full)]
    wire = pack_shards(shards, layout, torch.bfloat16)  # cast on the way in, as mixed precision would
    gathered16 = f.wait_tensor(f.all_gather_into_tensor(wire, world_size, group))
    out["gathered_bf16"] = [(u, t.bfloat16()) for u, t in zip(unpack_gathered(gathered16, layout), full)]

    reduced = f.wait_tensor(f.reduce_scatter_tensor(pack_grads(grads[rank], layout), "sum", world_size, group))
    existing = [torch.randn(layout.shard_shape(i, rank), generator=gen) if i % 2 else None for i in range(len(shapes))]
    expected_acc = [e.clone() if e is not None else None for e in existing]
    got = average_into_shards(reduced, layout, rank, existing)
    # the per-parameter path zerofx's reduce pass emits: pad, reduce-scatter "avg", slice
    per_param = []
    for i, g in enumerate(grads[rank]):
        rows = -(-g.shape[0] // world_size)
        padded = torch.nn.functional.pad(g, [0, 0] * (g.dim() - 1) + [0, rows * world_size - g.shape[0]])
        red = f.wait_tensor(f.reduce_scatter_tensor(padded.contiguous(), "avg", world_size, group))
        shard = red[: layout.shard_shape(i, rank)[0]]
        per_param.append(shard + expected_acc[i] if expected_acc[i] is not None else shard)
    out["grads"] = list(zip(got, per_param))
    out["accumulated_in_place"] = all(got[i] is existing[i] for i in range(len(shapes)) if existing[i] is not None)
    return out


def run(rank: int, world_size: int, dump_dir: str) -> bytes:
    """Everything the codegen multi-rank tests assert on, for this rank (``torch.save``d: tensors
    sent through a multiprocessing queue would live in shared memory the exiting rank takes along)."""
    results: dict = {}
    parts = [
        (f"gpt_{ex}", lambda ex=ex: train(rank, world_size, "gpt", ex, dump_dir if ex == "triton" else None))
        for ex in ("aten", "triton")
    ]
    if world_size > 1:
        parts += [("bucket", lambda: bucket_roundtrip(rank, world_size))]
        parts += [(f"mlp_{ex}", lambda ex=ex: train(rank, world_size, "mlp", ex, None)) for ex in ("aten", "inductor")]
    for name, part in parts:
        try:
            results[name] = part()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()
