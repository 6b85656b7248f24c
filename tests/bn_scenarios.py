"""Rank-side half of tests/test_mixed_precision_bn.py: a BatchNorm CNN (zerofx.models.ResNet)
trained by zerofx and by unsharded references on every rank.

Data parallelism with BatchNorm: each rank normalizes with its own slice's batch statistics and
updates its own running statistics (buffers are not synchronized, as in FSDP and DDP without
``broadcast_buffers``). So the references run the global batch one rank-slice at a time, each
slice with that rank's copy of the buffers, and sum ``loss / world`` gradients over the slices:
the same gradients zerofx averages. The references start from the same weights:

* ``fp32``: everything in fp32, the result mixed precision is meant to approximate;
* ``bf16``: the unsharded model with zerofx's documented mixed-precision arithmetic
  (docs/zero_stages.md, Mixed precision): inputs and every parameter but the norm layers' cast to
  bf16 from the fp32 masters, norm weights and running stats fp32, the same AdamW on the fp32
  masters. zerofx's distance from it is what sharding costs;
* ``autocast``: the unsharded fp32 model under ``torch.autocast("cpu", bfloat16)``, torch's own
  mixed precision (the same bf16 convolutions; the loss in fp32). Its distance from ``fp32`` is
  what bf16 costs on this model, measured without zerofx.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.func import functional_call

import zerofx
from tests.multirank import attempt, mean_over_ranks
from zerofx.models import ResNet, ResNetConfig, random_images

CFG = ResNetConfig()  # widths (8, 16), one block each (the second with a projection), 8x8 images
PER_RANK = 4  # images per rank: BatchNorm statistics over 4·8·8 values per channel in the first stage
LR = 1e-3
STEPS = 5
STAT_NAMES = ("running_mean", "running_var")
FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # the fp32 tolerance style of tests/zero_scenarios.py


class _Reference:
    """The unsharded model, data parallel by slices (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, world: int, compute: torch.dtype | str | None):
        self.model, self.world, self.compute = model, world, compute
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.buffers = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(world)]
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
        self.norm_params = {id(p) for m in norms for p in m.parameters()}

    def _forward(self, x, y):
        if self.compute is None:
            return self.model(x, y)
        if self.compute == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(x, y)
        params = {n: p if id(p) in self.norm_params else p.to(self.compute) for n, p in self.model.named_parameters()}
        return functional_call(self.model, params, (x.to(self.compute), y))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """One optimizer step on the global batch; each rank-slice's loss."""
        losses = []
        own = dict(self.model.named_buffers())
        for r in range(self.world):
            rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
            with torch.no_grad():
                for n, b in own.items():
                    b.copy_(self.buffers[r][n])
            loss = self._forward(x[rows], y[rows])
            (loss / self.world).backward()
            losses.append(loss.item())
            with torch.no_grad():
                for n, b in own.items():
                    self.buffers[r][n].copy_(b)
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        self.opt.step()
        self.opt.zero_grad()
        return losses


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: an error relative to the tensor's scale (relative errors of
    single near-zero entries mean nothing in bf16)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _errors(record: dict, tag: str, mine: dict, ref: dict) -> None:
    """Record ``mine`` against ``ref`` (both {kind: {name: tensor}}): per tensor errors, bitwise
    equality, and what fails FP32_TOL."""
    for kind, tensors in mine.items():
        record[f"{kind}_{tag}"] = {n: _rel(t, ref[kind][n]) for n, t in tensors.items()}
        record[f"{kind}_exact_{tag}"] = all(torch.equal(t, ref[kind][n]) for n, t in tensors.items())
    record[f"{tag}_failures"] = []
    for kind, tensors in mine.items():
        for n, t in tensors.items():
            try:
                torch.testing.assert_close(t, ref[kind][n], **FP32_TOL)
            except AssertionError as e:
                record[f"{tag}_failures"].append(f"{kind} {n}: {' '.join(str(e).split()[:30])}")


def train(rank: int, world: int, mesh, options: dict) -> dict:
    """Train zerofx and the references STEPS steps; per step, every tensor's error against each
    (gradients and parameters whole, running statistics this rank's)."""
    mixed = options.get("param_dtype") is not None
    torch.manual_seed(0)
    model = ResNet(CFG)
    refs = {"fp32": _Reference(copy.deepcopy(model), world, None)}
    if mixed:
        refs["bf16"] = _Reference(copy.deepcopy(model), world, torch.bfloat16)
        refs["autocast"] = _Reference(copy.deepcopy(model), world, "autocast")
    zerofx.compile(model, mesh, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1234)
    out: dict = {
        "steps": [],
        "buffer_dtypes": sorted({str(b.dtype) for n, b in model.named_buffers() if n.endswith(STAT_NAMES)}),
    }
    for step in range(STEPS):
        x, y = random_images(CFG, PER_RANK * world, gen)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = model(x[rows], y[rows])
        loss.backward()
        record = {"loss": loss.item(), "loss_mean": mean_over_ranks(loss.float()), "loss_dtype": str(loss.dtype)}
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        mine = {
            "grad": grads,
            "param": {n: p.full_tensor() for n, p in model.named_parameters()},
            "buffer": {n: b.clone() for n, b in model.named_buffers() if n.endswith(STAT_NAMES)},
        }
        seen = {}
        for tag, ref in refs.items():
            losses = ref.step(x, y)
            record[f"loss_{tag}"], record[f"loss_mean_{tag}"] = losses[rank], sum(losses) / world
            seen[tag] = {
                "grad": ref.grads,
                "param": {n: p.detach() for n, p in ref.model.named_parameters()},
                "buffer": {n: ref.buffers[rank][n] for n in mine["buffer"]},
            }
            _errors(record, tag, mine, seen[tag])
        ref_params = seen["fp32"]["param"]
        record["param_abs_fp32"] = max((p - ref_params[n]).abs().max().item() for n, p in mine["param"].items())
        record["param_scale"] = max(p.abs().max().item() for p in ref_params.values())
        for tag in ("bf16", "autocast") if mixed else ():  # what bf16 itself costs, without zerofx
            for kind in mine:
                record[f"{kind}_{tag}_vs_fp32"] = {
                    n: _rel(t, seen["fp32"][kind][n]) for n, t in seen[tag][kind].items()
                }
        out["steps"].append(record)
    return out


def scenarios(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for stage in (1, 2, 3):
        attempt(
            out, f"bf16_stage{stage}", lambda: train(rank, world, mesh, {"stage": stage, "param_dtype": torch.bfloat16})
        )
    for stage in (1, 2, 3):
        attempt(out, f"fp32_stage{stage}", lambda: train(rank, world, mesh, {"stage": stage}))
    return out
