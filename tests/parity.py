"""Rank-side half of the parity tests: train zerofx and an unsharded reference side by side.

Every rank builds the model from one seed, keeps an unsharded copy as the reference (trained
in this same process on the whole global batch with plain eager AdamW), shards and compiles
the other copy with zerofx, and trains it on its slice of the global batch. It returns what the
test asserts on: losses per step, every mismatch of a local param/grad shard against the
reference sliced the same way, model-state bytes and their numel-derived bound, and the
collective bytes of the last step.
"""

from __future__ import annotations

import copy
import math
import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zerofx
from tests.models import CASES
from tests.multirank import mean_over_ranks
from zerofx.ir.layout import shard_dim
from zerofx.testing import ShardedReference, exact_divergence, shard_rows

# Tolerances of the loss-only and mixed-precision checks elsewhere (tests/test_memory.py); the
# fp32 parity of this file is bitwise (zerofx.testing.ShardedReference).
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)
# The whole-batch reference's losses may differ from zerofx's by rounding only: it sums over the
# global batch in other shapes, so other kernels and orders. The allowed difference is measured in
# the same run, not guessed: a sibling of the whole-batch reference trained on the same batch split
# into 2N micro-batches (another split than zerofx's N slices) shows how far a mere re-association
# of the batch sum moves the loss trajectory; zerofx's split may move it as far, and AdamW's
# normalized update makes such walks grow at similar rates but not equal ones, so we allow
# SPLIT_FACTOR times the sibling's envelope (max so far) plus LOSS_ULPS ulps of the loss.
SPLIT_FACTOR = 4
LOSS_ULPS = 8


reference_shard = shard_rows  # the rows of a full tensor that a rank owns under Shard(0)


def _unique_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(model.named_parameters())  # named_parameters() already skips tied duplicates


def numel_accounting(ref: torch.nn.Module, world_size: int) -> dict[str, int]:
    """Everything the bounds need, computed from numel of the unsharded model."""
    out = dict(total=0, bound=0, psi=0, psi_trainable=0, psi_pad=0, psi_trainable_pad=0)
    for _, p in _unique_params(ref):
        copies = 4 if p.requires_grad else 1  # param (+ grad + Adam's exp_avg, exp_avg_sq)
        out["total"] += p.numel() * p.element_size() * copies
        out["psi"] += p.numel() * p.element_size()
        out["psi_trainable"] += p.numel() * p.element_size() if p.requires_grad else 0
        if p.dim() == 0:  # kept whole on every rank: never gathered or reduce-scattered
            out["bound"] += p.element_size() * copies
            continue
        dim = shard_dim(p.shape, world_size)  # the dim zerofx splits (NOTE: the sharded dim)
        row = p.numel() // max(p.shape[dim], 1)
        padded = -(-p.shape[dim] // world_size) * world_size * row * p.element_size()
        out["bound"] += padded // world_size * copies
        out["psi_pad"] += padded
        out["psi_trainable_pad"] += padded if p.requires_grad else 0
    return out


def _accumulated_loss(model: torch.nn.Module, x, y, parts: int) -> float:
    """Forward and backward of the whole batch in ``parts`` micro-batches (gradients accumulate)."""
    total = 0.0
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
        loss = model(xs, ys) / parts
        loss.backward()
        total += loss.item()
    return total


def train_case(name: str, rank: int, world_size: int, steps: int, dump_dir: str | None) -> dict:
    """zerofx against the ShardedReference (bitwise; its divergences are the ``failures``) and
    the whole-batch losses against the unsharded model and its 2N-split sibling."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build()
    replica, whole, split = (copy.deepcopy(model) for _ in range(3))
    mesh = init_device_mesh("cpu", (world_size,))
    options = {"dump_dir": dump_dir} if dump_dir else {}
    zerofx.compile(model, mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr)
    ref = ShardedReference(replica, model, lambda ps: torch.optim.AdamW(ps, lr=case.lr))
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=case.lr)
    split_opt = torch.optim.AdamW(split.parameters(), lr=case.lr)
    gen = torch.Generator().manual_seed(1234)
    per_rank = 2
    result = dict(
        losses=[],
        ref_losses=[],
        split_losses=[],
        failures=[],
        bounded=set(),
        accounting=numel_accounting(whole, world_size),
    )

    for step in range(steps):
        x, y = case.batch(per_rank * world_size, gen)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        with zerofx.CollectiveCounter() as fw_comm:
            loss = model(x[mine], y[mine])
        with zerofx.CollectiveCounter() as bw_comm:
            loss.backward()
        ref_loss = ref.backward(lambda m: m(x[mine], y[mine]))
        d = exact_divergence(step, "loss", "loss", loss.detach(), ref_loss)
        found = [str(d)] if d else []
        ref.reduce_gradients()
        found += map(str, ref.check_gradients(model, step))
        result["bounded"].update(ref.bounded)
        for p in model.parameters():
            assert isinstance(p, DTensor) or world_size == 1, "a parameter is not sharded"

        result["losses"].append(mean_over_ranks(loss))
        result["ref_losses"].append(_accumulated_loss(whole, x, y, 1))
        result["split_losses"].append(_accumulated_loss(split, x, y, 2 * world_size))
        opt.step()
        ref.step()
        whole_opt.step()
        split_opt.step()
        if step == steps - 1:
            result["state_bytes"] = zerofx.model_state_bytes(model, opt).total
            result["comm_forward"] = dict(fw_comm.bytes)
            result["comm_backward"] = dict(bw_comm.bytes)
        for o in (opt, whole_opt, split_opt):
            o.zero_grad()
        found += map(str, ref.check_parameters(model, step))
        result["failures"] += found

    result["bounded"] = sorted(result["bounded"])
    assert all(math.isfinite(v) for v in result["losses"])
    return result


def step_against_reference(model, opt, ref: ShardedReference, step: int, loss, loss_fn) -> list[str]:
    """After ``loss.backward()`` on ``model``: the same step on ``ref`` (``loss_fn`` runs the
    replica), both optimizers stepped, and every divergence (loss, gradients, parameters) as text."""
    ref_loss = ref.backward(loss_fn)
    d = exact_divergence(step, "loss", "loss", loss.detach(), ref_loss)
    found = [str(d)] if d else []
    ref.reduce_gradients()
    found += map(str, ref.check_gradients(model, step))
    opt.step()
    ref.step()
    opt.zero_grad()
    found += map(str, ref.check_parameters(model, step))
    return found


def loss_tolerances(r: dict) -> list[float]:
    """Per step, how far zerofx's loss may be from the whole-batch reference's (see SPLIT_FACTOR)."""
    out, envelope = [], 0.0
    for whole, split in zip(r["ref_losses"], r["split_losses"]):
        envelope = max(envelope, abs(split - whole))
        out.append(SPLIT_FACTOR * envelope + LOSS_ULPS * torch.finfo(torch.float32).eps * abs(whole))
    return out


def train_all(rank: int, world_size: int, names: list[str], steps: int, dump_dir: str | None) -> dict:
    """Run every case on this rank; one case failing does not hide the others."""
    import traceback

    out = {}
    for name in names:
        try:
            dump = None if dump_dir is None or name not in ("gpt", "experts") else dump_dir
            if dump is not None and name != "gpt":  # (the GPT's graphs at the top: the tests read them there)
                dump = os.path.join(dump, name)
            out[name] = train_case(name, rank, world_size, steps, dump)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        torch._dynamo.reset()
    return out
