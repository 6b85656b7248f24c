"""Rank-side half of tests/test_zero_stages.py: every ZeRO knob trained against a reference.

One process group per world size runs every scenario (``scenarios_w2`` / ``scenarios_w4``);
each scenario returns plain data (losses, mismatches, bytes) that the tests assert on. The
reference is the unsharded model trained in the same process on the whole global batch.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zerofx
from tests.models import CASES
from tests.multirank import mean_over_ranks
from tests.parity import numel_accounting, reference_shard
from zerofx.runtime.params import runtime_of
from zerofx.testing import ShardedReference, exact_divergence

PER_RANK = 2  # samples per rank per micro-batch


def _accounting(ref: torch.nn.Module, shard_size: int, threshold: int) -> dict:
    """Ψ of the unsharded model in bytes (tied parameters once), split into the parameters kept
    whole (by the persistence threshold, or 0-dim) and the sharded ones (also padded to ``shard_size``)."""
    acc = numel_accounting(ref, shard_size)
    whole = [p for p in ref.parameters() if p.numel() <= threshold or p.dim() == 0]
    acc["psi_whole"] = sum(p.numel() * p.element_size() for p in whole)
    return acc


def _expected_local(full: torch.Tensor, p: DTensor, shard_rank: int, shard_size: int) -> torch.Tensor:
    """The reference tensor sliced the way ``p`` holds it (whole for Replicate placements)."""
    last = p.placements[-1]
    return reference_shard(full, shard_rank, shard_size, last.dim) if last.is_shard() else full


def train(
    rank: int,
    world: int,
    mesh,
    case_name: str,
    steps: int,
    options: dict,
    *,
    accum: int = 1,
    clip: float | None = None,
    check_tensors: bool = True,
) -> dict:
    """Train zerofx and the references side by side; return what the tests assert on.

    With ``check_tensors`` (fp32) the ShardedReference (zerofx.testing) checks every loss, local
    gradient and parameter shard and buffer, every step, bit for bit (or within the any-order
    summation bound where the backend picks the order: reported as ``bounded``); its findings
    are the ``failures``. The whole-batch unsharded model gives ``ref_losses`` and, with
    clipping, ``ref_norms``. Mixed-precision runs record instead the step-0 gradient error
    relative to each gradient's largest entry against the whole-batch model (the weights are
    still equal then)."""
    case = CASES[case_name]
    torch.manual_seed(0)
    model = case.build()
    ref, replica = copy.deepcopy(model), copy.deepcopy(model)
    zerofx.compile(model, mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=case.lr)
    oracle = ShardedReference(replica, model, lambda ps: torch.optim.AdamW(ps, lr=case.lr)) if check_tensors else None
    hybrid = mesh.ndim == 2
    shard_rank, shard_size = (mesh.get_local_rank(1), mesh.size(1)) if hybrid else (rank, world)
    gen = torch.Generator().manual_seed(1234)
    out = dict(
        losses=[],
        ref_losses=[],
        failures=[],
        bounded=set(),
        norms=[],
        ref_norms=[],
        grad_rel_err=0.0,
        acc=_accounting(ref, shard_size, options.get("persistence_threshold", 0)),
    )
    named_ref = dict(ref.named_parameters())

    for step in range(steps):
        x, y = case.batch(PER_RANK * world * accum, gen)
        fw = zerofx.CollectiveCounter()
        bw = zerofx.CollectiveCounter()
        total_loss = torch.zeros(())
        found = []
        for k in range(accum):
            micro = slice(k * PER_RANK * world + rank * PER_RANK, k * PER_RANK * world + (rank + 1) * PER_RANK)
            no_sync = zerofx.no_sync(model) if k < accum - 1 else contextlib.nullcontext()
            with no_sync:
                with fw:
                    loss = model(x[micro], y[micro]) / accum
                with bw:
                    loss.backward()
            total_loss += loss.detach().float()
            if oracle is not None:
                ref_loss = oracle.backward(lambda m: m(x[micro], y[micro]) / accum)
                d = exact_divergence(step, "loss", f"loss (micro-batch {k})", loss.detach(), ref_loss)
                found += [d] if d else []
        ref_loss = ref(x, y)
        ref_loss.backward()
        dist.all_reduce(total_loss)
        out["losses"].append(total_loss.item() / world)
        out["ref_losses"].append(ref_loss.item())

        if oracle is not None:
            oracle.reduce_gradients()
            found += oracle.check_gradients(model, step)
            out["bounded"].update(oracle.bounded)
        elif step == 0:
            for name, p in model.named_parameters():
                expect = _expected_local(named_ref[name].grad, p, shard_rank, shard_size)
                if expect.numel():
                    err = (p.grad.to_local() - expect).abs().max() / named_ref[name].grad.abs().max()
                    out["grad_rel_err"] = max(out["grad_rel_err"], err.item())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            out["norms"].append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
            out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
            if oracle is not None:
                found += oracle.clip_grad_norm_(clip, norm, step=step)
        with zerofx.CollectiveCounter() as at_step:
            opt.step()
        ref_opt.step()
        if oracle is not None:
            oracle.step()
        if step == steps - 1:
            out["state"] = zerofx.model_state_bytes(model, opt).__dict__
            out["comm"] = {"forward": dict(fw.bytes), "backward": dict(bw.bytes), "step": dict(at_step.bytes)}
            out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
            out["layout"] = {n: (str(p.placements), list(p.to_local().shape)) for n, p in model.named_parameters()}
            out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        opt.zero_grad()
        ref_opt.zero_grad()
        if oracle is not None:
            found += oracle.check_parameters(model, step)
        out["failures"] += map(str, found)
    out["bounded"] = sorted(out["bounded"])
    return out


def fp16_loss_scaling(rank: int, world: int, mesh) -> dict:
    """fp16 with dynamic loss scaling, started at a scale that must overflow: every step records
    the scale before/after and whether the parameters moved."""
    torch.manual_seed(0)
    model = CASES["mlp"].build()
    zerofx.compile(
        model, mesh, param_dtype=torch.float16, loss_scale="dynamic", initial_loss_scale=2.0**24, loss_scale_window=2
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = zerofx.loss_scaler(model)
    gen = torch.Generator().manual_seed(5)
    history = []
    for _ in range(14):
        x, y = CASES["mlp"].batch(PER_RANK * world, gen)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        before = [p.to_local().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        scaler.scale(model(x[mine], y[mine])).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
        finite = all(torch.isfinite(p.to_local()).all().item() for p in model.parameters())
        history.append({"scale": scale, "next_scale": scaler.get_scale(), "moved": moved, "finite": finite})
    return {"history": history, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def fused_overflow_agreement(rank: int, world: int, mesh) -> dict:
    """scaler.step on AdamW(fused=True) with an inf only in rank 1's shard of a sharded weight,
    behind a weight kept whole (the first gradient is replicated), without and with unscale_
    first: whether each rank called the optimizer's step, and the scale after."""
    out = {}
    for unscale in (False, True):
        torch.manual_seed(0)
        layers = [nn.Linear(4, 4, bias=False), nn.Linear(4, 64, bias=False)]
        model = zerofx.compile(nn.Sequential(*layers), mesh, persistence_threshold=16, loss_scale="dynamic")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        calls = []
        opt.register_step_pre_hook(lambda *_: calls.append(1))
        scaler = zerofx.loss_scaler(model)
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        sharded = [p for p in model.parameters() if p.placements[0].is_shard()]
        if rank == 1:
            sharded[0].grad.to_local()[0, 0] = math.inf
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        out[f"unscale={unscale}"] = {
            "replicated": [p.placements[0].is_replicate() for p in model.parameters()],
            "stepped": len(calls),
            "scale": scaler.get_scale(),
        }
    return out


def checkpoint_source(rank: int, world: int, mesh, folder: str, case: str = "uneven") -> dict:
    """At 4 ranks: train 3 steps, save, train 3 more (the uninterrupted trajectory); then a
    fresh, differently initialized model loads the checkpoint and trains the same 3 steps."""
    path = Path(folder) / ("ckpt" if case == "uneven" else f"ckpt_{case}")

    def batch(step):
        return CASES[case].batch(PER_RANK * world, torch.Generator().manual_seed(100 + step))

    def run_steps(model, opt, steps):
        losses = []
        for step in steps:
            x, y = batch(step)
            loss = model(x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
        return losses

    torch.manual_seed(0)
    model = zerofx.compile(CASES[case].build(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = run_steps(model, opt, range(3))
    zerofx.checkpoint.save(path, model, opt, extra={"step": 3})
    # cloned: a replicated DTensor's full_tensor() is its local tensor, which training goes on changing
    saved = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    uninterrupted = run_steps(model, opt, range(3, 6))
    torch._dynamo.reset()

    torch.manual_seed(1)  # different initial values: only the checkpoint can make them agree
    resumed_model = zerofx.compile(CASES[case].build(), mesh)
    resumed_opt = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    extra = zerofx.checkpoint.load(path, resumed_model, resumed_opt)
    resumed = run_steps(resumed_model, resumed_opt, range(extra["step"], 6))
    return {
        "first": first,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "extra": extra,
        "saved": {k: v.tolist() for k, v in saved.items()} if rank == 0 else None,
    }


def checkpoint_reshard(rank: int, world: int, mesh, folder: str, case: str = "uneven") -> dict:
    """At 2 ranks: load the 4-rank checkpoint (resharding) and train the same 3 steps; also into
    a stage-2 model (the same parameter layout, so ZeRO stages share checkpoints). For the
    experts, the 4-rank layout splits the stacked experts along dim 1, the 2-rank one along dim 0."""
    path = Path(folder) / ("ckpt" if case == "uneven" else f"ckpt_{case}")
    out = {}
    for stage in (3, 2):
        torch.manual_seed(1)
        model = zerofx.compile(CASES[case].build(), mesh, stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        extra = zerofx.checkpoint.load(path, model, opt)
        losses = []
        for step in range(extra["step"], 6):
            x, y = CASES[case].batch(PER_RANK * 4, torch.Generator().manual_seed(100 + step))
            # the 4-rank run's global batch, split over 2 ranks: the same global step
            half = slice(rank * 2 * PER_RANK, (rank + 1) * 2 * PER_RANK)
            loss = model(x[half], y[half])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
        out[f"stage{stage}"] = losses
        torch._dynamo.reset()
    return out


def state_dict_pickles(rank: int, world: int, mesh, stage: int) -> dict:
    """Stages 1 and 2: every rank's ``torch.save(model.state_dict())`` and ``copy.deepcopy`` of it
    (a shard past its storage's first element made both fail on every rank but the first), their
    values the parameters' shards, and no parameter counted as changed by taking it."""
    torch.manual_seed(0)
    model = zerofx.compile(CASES["mlp"].build(), mesh, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):  # the second step is the first local one (it left zerofx's state on the shards)
        model(*CASES["mlp"].batch(4, torch.Generator().manual_seed(rank))).backward()
        opt.step()
    states = runtime_of(model).states
    versions = [s.versions() for s in states]
    sd = model.state_dict()
    out: dict = {"versions_kept": versions == [s.versions() for s in states]}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    copied = copy.deepcopy(sd)
    params = dict(model.named_parameters())
    out["keys"] = sorted(loaded) == sorted(sd) == sorted(copied)
    out["saved_equal"] = all(torch.equal(loaded[k].to_local(), params[k].to_local()) for k in params)
    out["copied_equal"] = all(torch.equal(copied[k].to_local(), params[k].to_local()) for k in params)
    out["offsets"] = sorted({params[k].to_local().storage_offset() for k in params})  # some past 0 on rank 1
    return out


def _attempt(out: dict, name: str, fn, *args, **kwargs) -> None:
    start = time.perf_counter()
    try:
        out[name] = fn(*args, **kwargs)
    except Exception:
        out[name] = {"error": traceback.format_exc()}
    out[name]["seconds"] = time.perf_counter() - start
    torch._dynamo.reset()


def _small_buckets(fn, *args, **kwargs):
    """``fn`` with zerofx/runtime/eager_buckets.py's buckets capped at 128 bytes: the refresh and the boundary reduce
    then run in many buckets, some of one parameter, some of several."""
    from zerofx.runtime import eager_buckets as flat

    saved, flat.BUCKET_BYTES = flat.BUCKET_BYTES, 128
    try:
        return fn(*args, **kwargs)
    finally:
        flat.BUCKET_BYTES = saved


def scenarios_w2(rank: int, world: int, steps: int, folder: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for stage in (1, 2, 3):
        _attempt(out, f"mlp_stage{stage}", train, rank, world, mesh, "mlp", steps, {"stage": stage})
        _attempt(out, f"uneven_stage{stage}", train, rank, world, mesh, "uneven", steps, {"stage": stage})
        _attempt(
            out,
            f"accum_clip_stage{stage}",
            train,
            rank,
            world,
            mesh,
            "uneven",
            steps,
            {"stage": stage},
            accum=3,
            clip=0.05,
        )
        _attempt(
            out,
            f"mlp_bf16_stage{stage}",
            train,
            rank,
            world,
            mesh,
            "mlp",
            steps,
            {"stage": stage, "param_dtype": torch.bfloat16},
            check_tensors=False,
        )
    _attempt(
        out, "uneven_stage1_small_buckets", _small_buckets, train, rank, world, mesh, "uneven", steps, {"stage": 1}
    )
    _attempt(
        out,
        "accum_clip_stage2_small_buckets",
        _small_buckets,
        train,
        rank,
        world,
        mesh,
        "uneven",
        steps,
        {"stage": 2},
        accum=3,
        clip=0.05,
    )
    for stage in (1, 2):  # tied weights (and stage 3's GPT runs in tests/test_parity.py)
        _attempt(out, f"gpt_stage{stage}", train, rank, world, mesh, "gpt", steps, {"stage": stage})
        _attempt(out, f"state_dict_pickles_stage{stage}", state_dict_pickles, rank, world, mesh, stage)
    _attempt(out, "gpt_accum_clip_stage3", train, rank, world, mesh, "gpt", 2, {}, accum=2, clip=0.5)
    _attempt(out, "gpt_persist", train, rank, world, mesh, "gpt", steps, {"persistence_threshold": 100})
    _attempt(
        out, "gpt_bf16", train, rank, world, mesh, "gpt", steps, {"param_dtype": torch.bfloat16}, check_tensors=False
    )
    _attempt(out, "fp16_loss_scaling", fp16_loss_scaling, rank, world, mesh)
    _attempt(out, "fused_overflow_agreement", fused_overflow_agreement, rank, world, mesh)
    _attempt(out, "checkpoint_reshard", checkpoint_reshard, rank, world, mesh, folder)
    _experts(out, rank, world, mesh, steps)
    _attempt(out, "experts_checkpoint_reshard", checkpoint_reshard, rank, world, mesh, folder, "experts")
    return out


def _experts(out: dict, rank: int, world: int, mesh, steps: int) -> None:
    """Stacked experts split along another dim than 0 (tests.models.ExpertsNet), every stage."""
    for stage in (1, 2, 3):
        _attempt(out, f"experts_stage{stage}", train, rank, world, mesh, "experts", steps, {"stage": stage})


def scenarios_w4(rank: int, world: int, steps: int, folder: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for stage in (1, 2, 3):
        _attempt(out, f"mlp_stage{stage}", train, rank, world, mesh, "mlp", steps, {"stage": stage})
        _attempt(out, f"uneven_stage{stage}", train, rank, world, mesh, "uneven", steps, {"stage": stage})
        _attempt(
            out,
            f"accum_clip_stage{stage}",
            train,
            rank,
            world,
            mesh,
            "uneven",
            steps,
            {"stage": stage},
            accum=2,
            clip=0.05,
        )
    _attempt(
        out,
        "mlp_bf16_stage3",
        train,
        rank,
        world,
        mesh,
        "mlp",
        steps,
        {"param_dtype": torch.bfloat16},
        check_tensors=False,
    )
    _attempt(out, "checkpoint_source", checkpoint_source, rank, world, mesh, folder)
    _experts(out, rank, world, mesh, steps)
    _attempt(out, "experts_checkpoint_source", checkpoint_source, rank, world, mesh, folder, "experts")
    hybrid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for stage in (1, 2, 3):
        _attempt(out, f"hybrid_mlp_stage{stage}", train, rank, world, hybrid, "mlp", steps, {"stage": stage})
    _attempt(out, "hybrid_mlp_persist", train, rank, world, hybrid, "mlp", steps, {"persistence_threshold": 300})
    _attempt(out, "hybrid_experts_stage3", train, rank, world, hybrid, "experts", steps, {})
    # hpZ: the primary split spans the flattened mesh (4 ranks: experts along dim 1)
    _attempt(out, "experts_hpz", train, rank, world, hybrid, "experts", steps, {"secondary_shard": True})
    _attempt(
        out,
        "hybrid_bf16_accum",
        train,
        rank,
        world,
        hybrid,
        "mlp",
        steps,
        {"param_dtype": torch.bfloat16},
        accum=2,
        check_tensors=False,
    )
    return out
