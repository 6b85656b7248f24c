"""Rank-side half of tests/test_zeropp.py: the ZeRO++ options trained on gloo ranks.

Each scenario trains a model from the same seed with one set of options and returns plain data:
the mean loss of every step, the collective bytes per phase (forward, backward) by kind, by
mesh dimension and by what was on the wire, and the numel of each parameter's padded shard.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerofx
from tests.models import CASES

PER_RANK = 2


def _dims(mesh, model) -> dict[str, str]:
    """process group name -> the mesh dimension it spans ("outer", "inner", or "world": every
    rank, as hpZ's primary partition over the flattened 2-D mesh)."""
    dims = {p.device_mesh.get_group(0).group_name: "world" for p in model.parameters() if p.device_mesh.ndim == 1}
    if mesh.ndim == 1:
        return {mesh.get_group(0).group_name: "world"}
    return {**dims, mesh.get_group(0).group_name: "outer", mesh.get_group(1).group_name: "inner"}


def train(mesh, case_name: str, options: dict, steps: int) -> dict:
    """``options["no_sync_first"]``: each step starts with a micro-batch under zerofx.no_sync
    (its backward's collectives counted as the phase "backward_no_sync")."""
    options = dict(options)
    no_sync_first = options.pop("no_sync_first", False)
    rank, world = dist.get_rank(), dist.get_world_size()
    case = CASES[case_name]
    torch.manual_seed(0)
    model = case.build()
    shard = mesh.size(mesh.ndim - 1) if not options.get("secondary_shard") else world
    shards = [math.ceil(p.shape[0] / shard) * math.prod(p.shape[1:]) for p in model.parameters()]
    zerofx.compile(model, mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr)
    gen = torch.Generator().manual_seed(1234)
    dims = _dims(mesh, model)
    out = dict(losses=[], comm={}, by_dim={}, by_wire={}, unquantized={}, shards=shards, params=[])
    for step in range(steps):
        x, y = case.batch(PER_RANK * world, gen)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        fw, bw, early = zerofx.CollectiveCounter(), zerofx.CollectiveCounter(), zerofx.CollectiveCounter()
        if no_sync_first:
            with zerofx.no_sync(model):
                early_loss = model(x[mine], y[mine])
                with early:
                    early_loss.backward()
        with fw:
            loss = model(x[mine], y[mine])
        with bw:
            loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / world)
        if step == 0:
            for phase, c in (("forward", fw), ("backward", bw), ("backward_no_sync", early)):
                out["comm"][phase] = dict(c.bytes)
                by_dim: Counter = Counter()
                for (kind, group), nbytes in c.by_group.items():
                    by_dim[(kind, dims.get(group, "other"))] += nbytes
                out["by_dim"][phase] = dict(by_dim)
                out["by_wire"][phase] = dict(c.by_wire)
                out["unquantized"][phase] = dict(c.unquantized)
    out["params"] = [p.detach().full_tensor().tolist() for p in model.parameters()]
    out["secondary_bytes"] = sum(zerofx.sharding.runtime_of(model).compiled.secondary_bytes.values())
    return out


def _secondary_shard_error(mesh, **options) -> str:
    """What ``secondary_shard=True`` (with ``options``) says on this mesh, "" when it is accepted."""
    model = CASES["mlp"].build()
    try:
        zerofx.compile(model, mesh, secondary_shard=True, **options)
    except zerofx.ZeroFXError as e:
        assert not zerofx.sharding.is_sharded(model)  # refused before anything changed
        return str(e)
    return ""


def _no_sync_warnings(mesh) -> list[str]:
    """The warnings of a no_sync window closed with quantize_grads on: its reduction, after the
    backward, is not quantized, which the user is told once."""
    import warnings

    torch._dynamo.reset()
    model = CASES["mlp"].build()
    zerofx.compile(model, mesh, quantize_grads="int8")
    x, y = CASES["mlp"].batch(PER_RANK, torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with zerofx.no_sync(model):
                model(x, y).backward()
            model(x, y).backward()
    torch._dynamo.reset()
    return [str(w.message) for w in seen if "quantize_grads" in str(w.message)]


def executors(rank: int, world: int) -> dict:
    """The MLP with int8 weights and int4 gradients on the "aten" and "triton" executors (Triton's
    interpreter on CPU): the losses of 3 steps, and how often the Triton quantize kernels ran."""
    from zerofx.codegen import quantize_kernels

    calls = Counter()

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    quantize_kernels._KERNELS.update({op: counted(op.name(), fn) for op, fn in quantize_kernels._KERNELS.items()})
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for executor in ("aten", "triton"):
        torch._dynamo.reset()
        options = dict(BYTES, executor=executor, quantize_weights="int8", quantize_grads="int4")
        out[executor] = train(mesh, "mlp", options, 3)["losses"]
    out["triton_calls"] = dict(calls)
    return out


def checkpoint(rank: int, world: int, path: str) -> dict:
    """hpZ's checkpoints are ZeRO-3's: save from a 2x2 hpZ run after one step, load into a fresh
    model (after a step of other data, so loading must overwrite it) laid out as hpZ, as hybrid
    sharding on the same mesh, and as ZeRO-3 on a 1-D mesh of the 4 ranks; each then takes the
    two steps the saving run took after saving. Returns the losses of those two steps per layout."""
    import zerofx.checkpoint

    torch.set_num_threads(1)
    case = CASES["gpt"]
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    gen = torch.Generator().manual_seed(1)
    batches = [case.batch(PER_RANK * world, gen) for _ in range(4)]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def build(mesh, **options):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = zerofx.compile(case.build(), mesh, **options)
        return model, torch.optim.AdamW(model.parameters(), lr=case.lr)

    def step(model, opt, batch) -> float:
        loss = model(batch[0][mine], batch[1][mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = build(mesh2, secondary_shard=True)
    step(model, opt, batches[0])
    zerofx.checkpoint.save(path, model, opt)
    out = {"saved": [step(model, opt, b) for b in batches[1:3]]}
    layouts = {
        "hpz": (mesh2, {"secondary_shard": True}),
        "hybrid": (mesh2, {}),
        "flat": (init_device_mesh("cpu", (world,)), {}),
    }
    for name, (mesh, options) in layouts.items():
        model, opt = build(mesh, **options)
        step(model, opt, batches[3])
        zerofx.checkpoint.load(path, model, opt)
        out[name] = [step(model, opt, b) for b in batches[1:3]]
    return out


BYTES = dict(bucket_bytes=0)  # one collective per parameter: bytes follow from each one's numel

W2 = {
    "mlp_plain": ("mlp", dict(BYTES), 2),
    "mlp_qw8": ("mlp", dict(BYTES, quantize_weights="int8"), 2),
    "mlp_qg4": ("mlp", dict(BYTES, quantize_grads="int4"), 2),
    "mlp_qg8_qw8_off": (
        "mlp",
        dict(BYTES, quantize_grads="int8", quantize_weights="int8", disable_passes=("quantize",)),
        2,
    ),
    "mlp_fp8": ("mlp", dict(BYTES, quantize_weights="fp8"), 2),
    "mlp_bf16": ("mlp", dict(BYTES, param_dtype=torch.bfloat16), 2),
    "mlp_bf16_qw8": ("mlp", dict(BYTES, param_dtype=torch.bfloat16, quantize_weights="int8"), 2),
    "gpt_plain": ("gpt", {}, 4),
    "gpt_qw8": ("gpt", dict(quantize_weights="int8"), 4),
    "gpt_qg4": ("gpt", dict(quantize_grads="int4"), 4),
    "gpt_all": ("gpt", dict(quantize_weights="int8", quantize_grads="int8"), 4),
}

W4 = {
    "hybrid_plain": ("mlp", dict(BYTES), 2),
    "hybrid_qg8": ("mlp", dict(BYTES, quantize_grads="int8"), 2),
    # hpZ against plain ZeRO-3 over the same 4 ranks (the 2x2 mesh flattened: FLAT)
    "flat_mlp": ("mlp", dict(BYTES), 3),
    "hpz_mlp": ("mlp", dict(BYTES, secondary_shard=True), 3),
    "hpz_mlp_off": ("mlp", dict(BYTES, secondary_shard=True, disable_passes=("secondary",)), 3),
    "hpz_mlp_no_sync": ("mlp", dict(BYTES, secondary_shard=True, no_sync_first=True), 2),
    "flat_gpt": ("gpt", {}, 3),
    "hpz_gpt": ("gpt", dict(secondary_shard=True), 3),
    "hpz_gpt_all": ("gpt", dict(secondary_shard=True, quantize_weights="int8", quantize_grads="int4"), 3),
}
FLAT = ("flat_mlp", "flat_gpt")


def run(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    if world == 2:
        mesh, scenarios = init_device_mesh("cpu", (2,)), W2
    else:
        mesh, scenarios = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), W4
    # a 1-D mesh has no inner dimension; on the 2x2 mesh, stages 1 and 2 gather nothing to keep
    results = {"secondary_shard_error": _secondary_shard_error(mesh, **({} if world == 2 else {"stage": 2}))}
    if world == 2:
        results["no_sync_warnings"] = _no_sync_warnings(mesh)
    if world == 4:  # a dimension of one rank: hpZ would only cost (memory, or a second copy)
        for shape in ((1, 4), (4, 1)):
            flat = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
            results[f"secondary_shard_error_{shape[0]}x{shape[1]}"] = _secondary_shard_error(flat)
    for name, (case, options, steps) in scenarios.items():
        torch._dynamo.reset()
        on = zerofx.sharding._flat_mesh(mesh) if name in FLAT else mesh
        results[name] = train(on, case, options, steps)
    if world == 4:  # the README's spelling: a 2-D mesh whose dimensions have no names
        torch._dynamo.reset()
        unnamed = init_device_mesh("cpu", (2, 2))
        results["hpz_mlp_unnamed"] = train(unnamed, "mlp", dict(BYTES, secondary_shard=True), 3)
    return results


def bucketed_blocks(rank: int, world: int, param_dtype: str | None = None) -> dict:
    """The test GPT's logits (qwZ int8) and gradients (qgZ int4) with the default buckets and
    with one collective per parameter, and each parameter's gradient error against the
    unquantized run (zerofx/ir/quantize.py, NOTE: segments)."""
    from tests.models import GPT_CFG
    from zerofx.models import GPT, random_batch

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    x, y = random_batch(GPT_CFG, PER_RANK * world, torch.Generator().manual_seed(5))
    mine = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    runs = {}
    extra = {"param_dtype": getattr(torch, param_dtype)} if param_dtype else {}
    for name, options in {
        "plain": {},
        "bucketed": dict(quantize_weights="int8", quantize_grads="int4"),
        "per_parameter": dict(quantize_weights="int8", quantize_grads="int4", bucket_bytes=0),
    }.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = zerofx.compile(GPT(GPT_CFG), mesh, **options, **extra)
        logits = model(x[mine])
        model(x[mine], y[mine]).backward()
        runs[name] = (logits.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()})
    plain, bucketed, per_param = runs["plain"][1], runs["bucketed"][1], runs["per_parameter"][1]
    return {
        "same_logits": torch.equal(runs["bucketed"][0], runs["per_parameter"][0]),
        "same_grads": [n for n in plain if not torch.equal(bucketed[n], per_param[n])],
        "error": {n: float((bucketed[n] - g).norm() / g.norm()) for n, g in plain.items()},
    }
