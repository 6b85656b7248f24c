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

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zerofx
from tests.models import CASES
from tests.multirank import mean_over_ranks

PARAM_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)


def reference_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The rows of ``full`` that ``rank`` owns under Shard(0) (torch.chunk) semantics."""
    rows = -(-full.shape[0] // world_size)
    return full[rank * rows: min((rank + 1) * rows, full.shape[0])]


def _unique_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(model.named_parameters())  # named_parameters() already skips tied duplicates


def numel_accounting(ref: torch.nn.Module, world_size: int) -> dict[str, int]:
    """Everything the bounds need, computed from numel of the unsharded model."""
    out = dict(total=0, bound=0, psi=0, psi_trainable=0, psi_pad=0, psi_trainable_pad=0)
    for _, p in _unique_params(ref):
        row = p.numel() // p.shape[0]
        padded = -(-p.shape[0] // world_size) * world_size * row * p.element_size()
        copies = 4 if p.requires_grad else 1  # param (+ grad + Adam's exp_avg, exp_avg_sq)
        out["total"] += p.numel() * p.element_size() * copies
        out["bound"] += padded // world_size * copies
        out["psi"] += p.numel() * p.element_size()
        out["psi_trainable"] += p.numel() * p.element_size() if p.requires_grad else 0
        out["psi_pad"] += padded
        out["psi_trainable_pad"] += padded if p.requires_grad else 0
    return out


def _compare(tag: str, local: torch.Tensor, ref: torch.Tensor, tol: dict, failures: list[str]) -> None:
    try:
        torch.testing.assert_close(local, ref, **tol)
    except AssertionError as e:
        failures.append(f"{tag}: {str(e).splitlines()[0]} {' '.join(str(e).split()[-12:])}")


def train_case(name: str, rank: int, world_size: int, steps: int, dump_dir: str | None) -> dict:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build()
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,))
    options = {"dump_dir": dump_dir} if dump_dir else {}
    zerofx.compile(model, mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=case.lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=case.lr)
    gen = torch.Generator().manual_seed(1234)
    per_rank = 2
    result = dict(losses=[], ref_losses=[], failures=[], accounting=numel_accounting(ref, world_size))

    for step in range(steps):
        x, y = case.batch(per_rank * world_size, gen)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        with zerofx.CollectiveCounter() as fw_comm:
            loss = model(x[mine], y[mine])
        with zerofx.CollectiveCounter() as bw_comm:
            loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()

        result["losses"].append(mean_over_ranks(loss))
        result["ref_losses"].append(ref_loss.item())

        named_ref = dict(_unique_params(ref))
        for pname, p in _unique_params(model):
            assert isinstance(p, DTensor) or world_size == 1, f"{pname} is not sharded"
            q = named_ref[pname]
            if q.grad is None or p.grad is None:
                if (q.grad is None) != (p.grad is None):
                    result["failures"].append(f"step {step} grad {pname}: presence differs")
                continue
            _compare(f"step {step} grad {pname}", p.grad.to_local(), reference_shard(q.grad, rank, world_size),
                     GRAD_TOL, result["failures"])

        opt.step()
        ref_opt.step()
        if step == steps - 1:
            result["state_bytes"] = zerofx.model_state_bytes(model, opt).total
            result["comm_forward"] = dict(fw_comm.bytes)
            result["comm_backward"] = dict(bw_comm.bytes)
        opt.zero_grad()
        ref_opt.zero_grad()
        for pname, p in _unique_params(model):
            _compare(f"step {step} param {pname}", p.to_local(), reference_shard(named_ref[pname].detach(), rank,
                     world_size), PARAM_TOL, result["failures"])

    for bname, buf in ref.named_buffers():
        _compare(f"buffer {bname}", dict(model.named_buffers())[bname], buf, dict(rtol=0, atol=0), result["failures"])
    assert all(math.isfinite(v) for v in result["losses"])
    return result


def train_all(rank: int, world_size: int, names: list[str], steps: int, dump_dir: str | None) -> dict:
    """Run every case on this rank; one case failing does not hide the others."""
    import traceback

    out = {}
    for name in names:
        try:
            out[name] = train_case(name, rank, world_size, steps, dump_dir if name == "gpt" else None)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        torch._dynamo.reset()
    return out
