"""Does a sharded model train exactly like the unsharded one? An oracle, and a tool around it.

A whole-batch reference (one unsharded model trained on the global batch) cannot decide that:
its matmuls see other shapes than each rank's slice, ATen, oneDNN and MKL block and sum them
differently on every CPU, and AdamW's normalized update turns a last-bit difference in a
near-zero gradient into a visible parameter difference. A tolerance tuned on one machine then
fails on the next. ``ShardedReference`` instead reproduces zerofx's arithmetic, so that in fp32
the two agree **bit for bit** on any CPU:

* the forward and backward run on an unsharded replica, on this rank's own slice of the batch
  (the same shapes, hence the same kernels and summation orders as zerofx's graphs);
* every rank's local gradients are all-gathered (an exact copy) and combined the way zerofx
  combines them: within a shard group, zerofx sums the ranks' chunks itself, in rank order
  (the transport pass on gloo, ``zerofx/runtime/eager_buckets.py``), then divides by the group size; across a
  replicate group the backend's all-reduce sums. The oracle adds in the same order;
* the optimizer is the user's own class with the same hyperparameters, stepping one leaf tensor
  per rank shard (``torch.chunk`` rows), so each element sits at the same offset of a tensor of
  the same length as in zerofx's local step: vectorized body and scalar tail match too.

With tensor parallelism (a model parallelized with ``parallelize_module`` on a TP mesh, then
given to zerofx with the data-parallel mesh), the replica is the same TP model, not given to
zerofx: the TP plan's arithmetic is the same on both sides, so only the data-parallel
reduction is reproduced (within each rank's data-parallel group, on the TP-local values; with
hybrid sharding, the shard dimension's sum and then the replicate dimension's).
Its gradient of a parameter the plan keeps replicated may be ``Partial`` over the TP group;
the oracle sums it there first, as zerofx's rebuilt DTensor does in its backward.

Where zerofx does not choose the order, the oracle cannot reproduce it, and says so: a
backend's all-reduce over more than two ranks (gloo's ring, NCCL), a backend's reduce-scatter
(NCCL, or gloo with the transport pass disabled), and the gradient norm that clipping
all-reduces. There it checks zerofx's value against a rigorous bound for *any* summation order
(Higham's: ``|fl(sum x_i) - sum x_i| <= gamma_{n-1} * sum |x_i|``, ``gamma_k = k*u/(1-k*u)``,
``u = 2**-24`` in fp32, the exact sum taken in fp64) and then adopts zerofx's value for the
step (teacher forcing), so later steps stay comparable bit for bit. Nothing is a guessed
tolerance: a value is either identical or within a bound that holds for every order of adding.

``verify`` (and ``zerofx verify MODULE:FACTORY`` on the command line) runs the check on a
user's model: N steps sharded and unsharded on the same data, a per-step report of the loss
difference and the worst gradient and parameter divergence by name, and the first divergent
step and tensor. It first builds the model twice and says so if the factory is not
deterministic (the two copies must start equal for any comparison to mean anything).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import math
import sys
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from zerofx.ir.offload_ops import bytes_view
from zerofx.layer_checkpointing import take_over
from zerofx.options import Options
from zerofx.runtime.eager_buckets import rank_ordered_sum

__all__ = [
    "ShardedReference",
    "Divergence",
    "StepReport",
    "VerifyReport",
    "verify",
    "shard_rows",
    "summation_bound",
    "load_factory",
    "exact_divergence",
]

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def shard_rows(full: torch.Tensor, index: int, count: int, dim: int = 0) -> torch.Tensor:
    """The part of ``full`` that shard ``index`` of ``count`` holds under ``Shard(dim)``
    (``torch.chunk`` semantics: equal chunks of ceil(size/count), the last ones short or empty)."""
    if full.dim() == 0:
        return full
    size = full.shape[dim]
    rows = -(-size // count)
    first = min(index * rows, size)
    return full.narrow(dim, first, min((index + 1) * rows, size) - first)


def summation_bound(terms: Sequence[torch.Tensor], divisions: int = 0) -> torch.Tensor:
    """Per element, a bound on |fl(sum of terms) / d - exact| over every order of adding.

    ``len(terms) - 1`` additions and ``divisions`` roundings of a quotient each contribute at
    most ``u`` relative error: Higham's gamma_{n-1+divisions} times the sum of magnitudes
    (fp64), in units of the final quotient when the caller divides it."""
    dtype = terms[0].dtype
    k = len(terms) - 1 + divisions
    u = UNIT_ROUNDOFF.get(dtype, 2.0**-24)
    gamma = k * u / (1 - k * u)
    magnitude = torch.stack([t.double().abs() for t in terms]).sum(0)
    return gamma * magnitude


@dataclass
class Divergence:
    """One tensor that differs: ``kind`` is loss, grad, param or buffer."""

    step: int
    kind: str
    name: str
    max_abs: float
    max_rel: float
    index: tuple
    count: int  # elements that differ
    numel: int
    note: str = ""

    def __str__(self) -> str:
        return (
            f"step {self.step} {self.kind} {self.name}: {self.count}/{self.numel} elements differ, "
            f"max |diff| {self.max_abs:.3g} (relative {self.max_rel:.3g}) at {list(self.index)}"
            + (f" [{self.note}]" if self.note else "")
        )


@dataclass
class StepReport:
    step: int
    loss: float
    ref_loss: float
    divergences: list[Divergence] = field(default_factory=list)
    bounded: list[str] = field(default_factory=list)  # matched within the summation bound, not bitwise

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.ref_loss)

    def worst(self, kind: str) -> Divergence | None:
        found = [d for d in self.divergences if d.kind == kind]
        return max(found, key=lambda d: d.max_abs) if found else None


# NOTE: library branches a trace takes
# The replica runs eagerly, zerofx's graphs are what dynamo traced, and a library may branch on
# which of the two it is in. transformers' masking does, in a way that changes the kernels: run
# eagerly, it reads the position ids, finds no packed sequences and no padding, skips the causal
# mask and calls SDPA with ``is_causal=True``; traced, it cannot read values (its ``is_tracing``
# is True), so it builds the mask and SDPA gets an explicit boolean one. The two kernels compute
# the same attention with other roundings on some CPUs (an AMD EPYC: the gradients of an HF
# Llama trained without a KV cache, as activation checkpointing and the HF Trainer train it,
# differed by 1e-8 in a quarter of their elements; an Intel Xeon happened to agree). So while the
# replica runs forward, transformers' masking is told it is traced, and both sides call the same
# kernel.


@contextlib.contextmanager
def branches_as_traced():
    """Within: transformers' masking branches as it does under dynamo (NOTE: library branches a
    trace takes): its ``is_tracing`` answers True, as it does by its definition in a graph dynamo
    traces (it asks ``is_torchdynamo_compiling()`` first). Nothing changes where transformers'
    masking is not imported, or inside a compiled region."""
    masking = sys.modules.get("transformers.masking_utils")
    asked = getattr(masking, "is_tracing", None)
    if not callable(asked) or torch.compiler.is_compiling():
        yield
        return
    masking.is_tracing = lambda *args, **kwargs: True
    try:
        yield
    finally:
        masking.is_tracing = asked


def exact_divergence(
    step: int, kind: str, name: str, got: torch.Tensor, want: torch.Tensor, note: str = ""
) -> Divergence | None:
    """None when ``got`` and ``want`` are bit for bit equal (shape, dtype and every value)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return Divergence(
            step,
            kind,
            name,
            math.inf,
            math.inf,
            (),
            got.numel(),
            want.numel(),
            f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}",
        )
    if torch.equal(got, want) or (
        got.numel() and torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    ):
        return None
    diff = (got.double() - want.double()).abs().nan_to_num(math.inf)
    differs = (diff > 0) | (got.isnan() != want.isnan())
    flat = int(diff.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape)) if got.dim() else ()
    scale = want.double().abs().reshape(-1)[flat].item() if got.numel() else 0.0
    worst = diff.reshape(-1)[flat].item() if got.numel() else 0.0
    return Divergence(
        step, kind, name, worst, worst / scale if scale else math.inf, index, int(differs.sum()), got.numel(), note
    )


@dataclass
class _Layout:
    """How one parameter is laid out and reduced, read from its DTensor placements."""

    sharded: bool  # Shard(dim) on the mesh's last dim (else replicated there)
    shard_index: int  # this rank's coordinate on the shard dim
    shard_count: int
    groups: list[list[list[int]]]  # per mesh dim, innermost first: the global ranks of each group
    dim: int = 0  # the tensor dim it is split along
    # with tensor parallelism: the data-parallel ranks of this rank's TP coordinate and their group
    ranks: list[int] | None = None
    group: Any = None

    def part(self, t: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """Shard ``index`` (this rank's by default) of the whole ``t``; ``t`` if not sharded."""
        if not self.sharded:
            return t
        return shard_rows(t, self.shard_index if index is None else index, self.shard_count, self.dim)


def _groups_per_dim(ranks: torch.Tensor) -> list[list[list[int]]]:
    """Per dim of a mesh's rank tensor, innermost first: the global ranks of each of its groups."""
    groups = []
    for dim in reversed(range(ranks.ndim)):
        moved = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim])
        groups.append([[int(r) for r in row] for row in moved])
    return groups


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedReference:
    """An unsharded replica that reproduces a zerofx model's arithmetic on this rank.

    Build it from a copy of the model taken *before* ``zerofx.compile`` (same initial values)
    and the compiled model; every rank of the mesh builds one. Per step, after zerofx's own
    forward and backward on this rank's slice::

        ref_loss = ref.backward(lambda m: m(x_mine, y_mine))   # (once per micro-batch)
        ref.reduce_gradients()          # a collective: every rank calls it
        report.divergences += ref.check_gradients(model, step)
        ref.clip_grad_norm_(max_norm, zerofx_norm)               # only if zerofx clipped
        opt.step(); ref.step()
        report.divergences += ref.check_parameters(model, step)

    ``optimizer_fn(params)`` builds the reference optimizer; give it the same class and
    hyperparameters as the model's. Only fp32 training can be compared bit for bit; mixed
    precision changes the arithmetic itself (see docs/zero_stages.md).
    """

    def __init__(self, replica: nn.Module, sharded: nn.Module, optimizer_fn: Callable[[list], Any]):
        from zerofx.runtime.params import runtime_of

        self.replica = replica
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = str(dist.get_backend())
        runtime = runtime_of(sharded)
        # with tensor parallelism gradients are combined within each TP coordinate's dp ranks only
        self.tp = runtime is not None and runtime.tp_mesh is not None
        ours = dict(sharded.named_parameters())
        self.params = dict(replica.named_parameters())
        missing = set(self.params) ^ set(ours)
        if missing:
            raise ValueError(f"replica and sharded model name different parameters: {sorted(missing)}")
        self.layouts = {name: self._layout(ours[name]) for name in self.params}
        # one leaf per shard of every parameter: the optimizer steps tensors of zerofx's lengths
        self.shards: dict[str, list[torch.Tensor]] = {}
        for name, p in self.params.items():
            lay = self.layouts[name]
            value = _local(p.detach())
            pieces = [lay.part(value, i) for i in range(lay.shard_count)] if lay.sharded else [value]
            self.shards[name] = [piece.clone().requires_grad_(p.requires_grad) for piece in pieces]
        self.optimizer = optimizer_fn([s for name in self.params for s in self.shards[name] if s.requires_grad])
        self.reduced: dict[str, torch.Tensor] = {}
        self.bounded: list[str] = []  # reduced in an order the backend chose (see the module docstring)
        self._terms: dict[str, tuple[list[torch.Tensor], int]] = {}  # their summands, for the bound

    def _layout(self, p: torch.Tensor) -> _Layout:
        if self.tp:  # (dp..., tp): zerofx's placements on the data-parallel dims come first
            return self._tp_layout(p)
        if not isinstance(p, DTensor):  # a one-rank mesh: nothing is sharded
            return _Layout(False, 0, 1, [[list(range(self.world))]])
        mesh = p.device_mesh
        groups = _groups_per_dim(mesh.mesh)
        last = p.placements[-1]
        sharded = last.is_shard()
        if type(last) not in (Shard, Replicate) or any(not q.is_replicate() for q in p.placements[:-1]):
            raise ValueError(f"ShardedReference knows (Replicate(), ...) Shard(dim) layouts only, not {p.placements}")
        dim = last.dim if sharded else 0
        return _Layout(sharded, mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1), groups, dim)

    def _tp_layout(self, p: DTensor) -> _Layout:
        """A parameter on the (dp..., tp) mesh: its data-parallel dims are the mesh's leading ones
        (one, two for hybrid sharding; hpZ's flattened one), the TP dim the last. Gradients are
        combined among the ranks of this rank's TP coordinate only."""
        mesh = p.device_mesh
        dp_ndim = mesh.ndim - 1
        tp_index = mesh.get_local_rank(dp_ndim)
        groups = _groups_per_dim(mesh.mesh.select(dp_ndim, tp_index))
        inner = p.placements[dp_ndim - 1]  # Shard(0), or _StridedShard(0) over TP rows
        if any(not q.is_replicate() for q in p.placements[: dp_ndim - 1]):
            raise ValueError(
                f"ShardedReference knows (Replicate(), ...) Shard(0) data-parallel layouts only, not {p.placements}"
            )
        if dp_ndim == 1:
            group = mesh.get_group(0)
        else:  # every data-parallel rank of this TP coordinate (flattening names a new group once)
            group = mesh[mesh.mesh_dim_names[:dp_ndim]]._flatten().get_group()
        ranks = sorted(r for g in groups[0] for r in g)  # the group's order (torch sorts a group's ranks)
        index, count = mesh.get_local_rank(dp_ndim - 1), mesh.size(dp_ndim - 1)
        return _Layout(not inner.is_replicate(), index, count, groups, ranks=ranks, group=group)

    # -- forward and backward on this rank's slice ---------------------------------------------

    def backward(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        """Run ``loss_fn(replica)`` and its backward; gradients accumulate like zerofx's
        (``zerofx.no_sync`` micro-batches: call once per micro-batch). Returns the loss.

        A TP replica's gradient that is ``Partial`` over the TP group is summed there after each
        micro-batch, as zerofx's rebuilt DTensor sums it in each backward, and only then added to
        what earlier micro-batches left: ``(a1 + b1) + (a2 + b2)``, not ``(a1 + a2) + (b1 + b2)``
        (another fp32 rounding, reported as a divergence where zerofx is right)."""
        held = {}
        for name, p in self.params.items():
            if isinstance(p, DTensor) and p.grad is not None:
                held[name], p.grad = p.grad, None
        with branches_as_traced():
            loss = loss_fn(self.replica)
        loss.backward()
        with torch.no_grad():
            for name, p in self.params.items():
                if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                    p.grad = p.grad.redistribute(placements=p.placements)
                if name in held:
                    p.grad = held[name] if p.grad is None else held[name] + p.grad
        return loss.detach()

    def _exact_order(self, lay: _Layout, dim: int) -> bool:
        """Whether zerofx (not the backend) fixes the order of the sum over mesh dim ``dim``
        (0 = innermost): its own rank-ordered sum of chunks, or two terms (a + b == b + a)."""
        size = len(lay.groups[dim][0])
        return size <= 2 or (dim == 0 and lay.sharded and self.backend == "gloo")

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Every rank's local gradients, combined as zerofx combines them (a collective)."""
        self.reduced.clear()
        self.bounded = []
        self._terms.clear()
        for name, p in self.params.items():
            if not p.requires_grad:
                continue
            lay = self.layouts[name]
            # on the parameter's device: a collective needs a backend for its tensors' device
            # (an NCCL group has none for CPU tensors)
            has = torch.tensor([p.grad is not None], dtype=torch.int32, device=p.device)
            dist.all_reduce(has)
            if int(has) == 0:
                continue
            # a parameter only some ranks used (an expert no token of this rank was routed to):
            # zerofx averages the users' gradients with zeros (zerofx/runtime/lockstep.py)
            grad = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            if isinstance(grad, DTensor):  # a TP replica's: Partial over TP where the plan replicates
                grad = grad.redistribute(placements=p.placements).to_local()
            local = grad.contiguous()
            ranks = lay.ranks if lay.ranks is not None else list(range(self.world))
            everyone = [torch.empty_like(local) for _ in ranks]
            dist.all_gather(everyone, local, group=lay.group)
            values = dict(zip(ranks, everyone))
            exact = True
            for dim, groups in enumerate(lay.groups):  # innermost (the shard dim) first
                exact &= self._exact_order(lay, dim)
                combined = {}
                for group in groups:
                    total = rank_ordered_sum(torch.stack([values[r] for r in group])) / len(group)
                    for r in group:
                        combined[r] = total
                values = combined
            self.reduced[name] = values[self.rank]
            if not exact:
                if self.tp:
                    raise ValueError(
                        f"{name}: with tensor parallelism the oracle reproduces data-parallel sums of two ranks "
                        "or gloo's sharded reduce only"
                    )
                self.bounded.append(name)
                self._terms[name] = (everyone, len(lay.groups))
        self.replica.zero_grad(set_to_none=True)

    def check_gradients(self, sharded: nn.Module, step: int) -> list[Divergence]:
        """This rank's gradient shards against the combined reference gradients: bit for bit,
        or within the summation bound where the backend chose the order (then zerofx's value
        is adopted for the step, a collective over those parameters)."""
        out = []
        for name, p in sharded.named_parameters():
            ref = self.reduced.get(name)
            if (p.grad is None) != (ref is None):
                out.append(
                    Divergence(
                        step,
                        "grad",
                        name,
                        math.inf,
                        math.inf,
                        (),
                        0,
                        0,
                        "zerofx has a gradient and the reference none"
                        if ref is None
                        else "the reference has a gradient and zerofx none",
                    )
                )
                continue
            if ref is None:
                continue
            lay = self.layouts[name]
            got = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            want = lay.part(ref)
            if name in self.bounded:
                everyone, divisions = self._terms[name]
                terms = [lay.part(t) for t in everyone]
                exact = torch.stack([t.double() for t in terms]).sum(0) / len(terms)
                bound = summation_bound(terms, divisions) / len(terms)
                excess = (got.double() - exact).abs() - bound
                if got.shape == exact.shape and bool((excess <= 0).all()):
                    continue
                d = exact_divergence(step, "grad", name, got, want, "beyond the any-order summation bound")
                if d is not None:
                    out.append(d)
            else:
                d = exact_divergence(step, "grad", name, got, want)
                if d is not None:
                    out.append(d)
        ours = dict(sharded.named_parameters())
        for name in self.bounded:  # teacher forcing: the step continues from zerofx's sum
            p = ours[name]
            full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            self.reduced[name] = full.detach().clone()
        return out

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, zerofx_norm: torch.Tensor | float, norm_type: float = 2.0, step: int = 0
    ) -> list[Divergence]:
        """Clip the reference gradients like ``torch.nn.utils.clip_grad_norm_`` did zerofx's.

        The global norm is an all-reduced sum whose order the backend chooses, so it is checked
        against the bound for a sum of non-negative squares (relative gamma_n, n the element
        count) and zerofx's norm is adopted; the clip itself is elementwise (bit for bit)."""
        if norm_type != 2.0:
            raise ValueError("ShardedReference.clip_grad_norm_ checks the 2-norm only")
        if isinstance(zerofx_norm, DTensor):
            zerofx_norm = zerofx_norm.full_tensor()
        theirs = float(zerofx_norm)
        grads = list(self.reduced.values())
        squares = sum(float(g.double().pow(2).sum()) for g in grads)
        n = sum(g.numel() for g in grads)
        if self.tp:  # TP-local gradients: a TP-sharded one's squares add up over TP
            tp_sharded = [
                g
                for name, g in self.reduced.items()
                if isinstance(self.params[name], DTensor) and any(pl.is_shard() for pl in self.params[name].placements)
            ]
            mesh = next(p.device_mesh for p in self.params.values() if isinstance(p, DTensor))
            sharded = torch.tensor(  # on the mesh's device: NCCL has no backend for CPU tensors
                [sum(float(g.double().pow(2).sum()) for g in tp_sharded), sum(g.numel() for g in tp_sharded)],
                dtype=torch.float64,
                device=torch.device(mesh.device_type),
            )
            everyone = sharded.clone()
            dist.all_reduce(everyone, group=mesh.get_group())
            squares += float(everyone[0] - sharded[0])
            n += int(everyone[1] - sharded[1])
        u = UNIT_ROUNDOFF[torch.float32]
        gamma = (n + 2) * u / (1 - (n + 2) * u)
        exact = math.sqrt(squares)
        out = []
        if abs(theirs - exact) > gamma * exact:
            out.append(
                Divergence(
                    step,
                    "grad",
                    "<global grad norm>",
                    abs(theirs - exact),
                    abs(theirs - exact) / exact if exact else math.inf,
                    (),
                    1,
                    1,
                    f"zerofx {theirs!r} vs reference {exact!r}",
                )
            )
        coef = torch.clamp(max_norm / (torch.tensor(theirs, dtype=torch.float32) + 1e-6), max=1.0)  # as torch does
        for g in grads:
            g.mul_(coef)
        return out

    @torch.no_grad()
    def step(self) -> None:
        """The optimizer step over the shard leaves, then the replica's parameters from them."""
        for name, pieces in self.shards.items():
            ref = self.reduced.get(name)
            lay = self.layouts[name]
            for i, piece in enumerate(pieces):
                piece.grad = None if ref is None else lay.part(ref, i).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for name, p in self.params.items():
            pieces = self.shards[name]
            lay = self.layouts[name]
            _local(p).copy_(torch.cat(pieces, dim=lay.dim) if lay.sharded and p.dim() else pieces[0])
        self.reduced.clear()

    def check_parameters(self, sharded: nn.Module, step: int) -> list[Divergence]:
        """This rank's parameter shards and every buffer against the reference, bit for bit."""
        out = []
        for name, p in sharded.named_parameters():
            lay = self.layouts[name]
            got = p.to_local() if isinstance(p, DTensor) else p
            want = self.shards[name][lay.shard_index if lay.sharded else 0]
            d = exact_divergence(step, "param", name, got.detach(), want.detach())
            if d is not None:
                out.append(d)
        theirs = dict(sharded.named_buffers())
        for name, b in self.replica.named_buffers():
            d = exact_divergence(step, "buffer", name, theirs[name], b)
            if d is not None:
                out.append(d)
        return out


# -- the user-facing check -----------------------------------------------------------------


@dataclass
class VerifyReport:
    """What ``verify`` found on this rank."""

    rank: int
    world_size: int
    steps: list[StepReport] = field(default_factory=list)
    problem: str = ""  # set when no comparison could be made (e.g. a non-deterministic factory)
    sharded: bool = True  # False on one rank, where zerofx keeps the model whole

    @property
    def first_divergence(self) -> Divergence | None:
        for s in self.steps:
            if s.divergences:
                order = {"loss": 0, "grad": 1, "param": 2, "buffer": 3}
                return min(s.divergences, key=lambda d: (order[d.kind], -d.max_abs))
        return None

    @property
    def ok(self) -> bool:
        return not self.problem and self.first_divergence is None and bool(self.steps)

    def format(self) -> str:
        lines = [f"rank {self.rank} of {self.world_size}:"]
        if self.problem:
            return "\n".join(lines + [f"  cannot verify: {self.problem}"])
        lines.append(f"  {'step':>4}  {'loss':>14}  {'|loss diff|':>11}  {'worst grad':<32}  worst param")
        for s in self.steps:
            g, p = s.worst("grad"), s.worst("param")
            lines.append(
                f"  {s.step:>4}  {s.loss:>14.8g}  {s.loss_diff:>11.3g}  "
                f"{(f'{g.name} {g.max_abs:.3g}' if g else 'bit-identical'):<32}  "
                f"{f'{p.name} {p.max_abs:.3g}' if p else 'bit-identical'}"
            )
        first = self.first_divergence
        if first is None:
            bounded = sorted({n for s in self.steps for n in s.bounded})
            lines.append(
                ("  sharded training matches the unsharded model bit for bit" if self.sharded else f"  {ONE_RANK}")
                + (f" (within the any-order summation bound for {', '.join(bounded)})" if bounded else "")
            )
        else:
            lines.append(f"  FIRST DIVERGENCE: {first}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "problem": self.problem,
            "sharded": self.sharded,
            "ok": self.ok,
            "first_divergence": None if self.first_divergence is None else asdict(self.first_divergence),
            "steps": [
                dict(
                    step=s.step,
                    loss=s.loss,
                    ref_loss=s.ref_loss,
                    loss_diff=s.loss_diff,
                    bounded=s.bounded,
                    divergences=[asdict(d) for d in s.divergences],
                )
                for s in self.steps
            ],
        }


def load_factory(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (a clear error for a bad spec)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected MODULE:FACTORY (e.g. mypkg.models:build), got {spec!r}")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import {module!r} for {spec!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable")
    return obj


def _build(factory: Callable[..., Any], kwargs: dict) -> tuple[nn.Module, Callable]:
    built = factory(**kwargs)
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module) and callable(built[1]):
        return built
    raise TypeError(
        "the factory must return (model, batch_fn): an nn.Module whose forward(*batch) returns a "
        "scalar loss, and batch_fn(n, generator) returning that batch's tuple of tensors "
        f"(n samples); got {type(built).__name__}"
    )


def _first_difference(a: nn.Module, b: nn.Module) -> str | None:
    sa, sb = a.state_dict(), b.state_dict()
    if list(sa) != list(sb):
        return "the two builds have different state_dict keys"
    for key in sa:
        if not torch.equal(sa[key], sb[key]):
            return f"{key!r} differs between two builds with the same seed"
    return None


# what a one-rank report says where a sharded one says "sharded training matches"
ONE_RANK = (
    "at world size 1 zerofx shards nothing (the model stays whole): its compiled training matches the "
    "unsharded model bit for bit (verify on 2 or more ranks to check sharding)"
)


def _digests(model: nn.Module) -> tuple[list[str], list[int]]:
    """Every parameter's and buffer's name, and a CRC-32 of its name, dtype, shape and bytes: equal
    only for the same values in the same places (a sum, or ``torch.hash_tensor``'s xor, is blind
    to rows in another order)."""
    names, digests = [], []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        data = t.detach().cpu().contiguous()
        crc = zlib.crc32(f"{name} {data.dtype} {tuple(data.shape)}".encode())
        names.append(name)
        digests.append(zlib.crc32(bytes_view(data), crc))
    return names, digests


def _rank_difference(model: nn.Module, world: int, device: torch.device) -> str | None:
    """Where this rank's ``model`` differs from another rank's, the same verdict on every rank
    (collectives on ``device``); None where every rank built the same parameters and buffers."""
    names, digests = _digests(model)
    count = torch.tensor([len(digests)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    if any(int(c) != len(digests) for c in counts):
        return f"they hold {sorted({int(c) for c in counts})} parameters and buffers"
    mine = torch.tensor(digests, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    for rank, theirs in enumerate(everyone):
        differ = (theirs != everyone[0]).nonzero()
        if differ.numel():
            return f"{names[int(differ[0])]!r} differs between rank 0 and rank {rank}"
    return None


def _check_batch(batch: Any) -> None:
    """``batch_fn``'s result is the forward's arguments: a tuple or list (a bare tensor would be
    iterated row by row into as many arguments)."""
    if not isinstance(batch, (tuple, list)):
        raise TypeError(
            "batch_fn(n, generator) must return a tuple (or list) of the forward's arguments, "
            f"model(*batch); got {type(batch).__name__}" + (": wrap it as (x,)" if torch.is_tensor(batch) else "")
        )


def verify(
    factory: Callable[..., Any],
    mesh,
    *,
    steps: int = 5,
    batch_per_rank: int = 2,
    seed: int = 0,
    lr: float = 1e-3,
    optimizer: str = "adamw",
    factory_kwargs: dict | None = None,
    max_grad_norm: float | None = None,
    **options: Any,
) -> VerifyReport:
    """Train ``factory()``'s model ``steps`` steps with zerofx on ``mesh`` and unsharded (the
    ``ShardedReference``) on the same data; report per step on this rank. Call on every rank.

    ``factory(**factory_kwargs)`` returns ``(model, batch_fn)``; ``batch_fn(n, generator)``
    returns a tuple of forward arguments with ``n`` samples, and ``model(*batch)`` a scalar
    mean loss. Every rank draws the same global batch of ``batch_per_rank * world`` samples
    and trains on its own slice. ``options`` go to ``zerofx.compile``.

    Refused in the report's ``problem`` (nothing is compared): a factory whose two builds differ,
    or whose ranks build different parameters or buffers (compared by a CRC of each tensor's
    bytes). On a one-rank mesh zerofx shards nothing (without tensor parallelism or
    ``param_dtype``): the report's ``sharded`` is False and it says so; what it checks then is
    zerofx's compiled training of the whole model (the GPU check's world-1 parity).
    """
    import zerofx

    make_opt = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=lr),
        "adam": lambda ps: torch.optim.Adam(ps, lr=lr),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9),
    }
    if optimizer not in make_opt:
        raise ValueError(f"optimizer must be one of {sorted(make_opt)}, got {optimizer!r}")
    if steps < 1 or batch_per_rank < 1:
        raise ValueError(f"steps and batch_per_rank must be at least 1, got {steps} and {batch_per_rank}")
    _refuse_other_arithmetic(options)
    world, rank = dist.get_world_size(), dist.get_rank()
    report = VerifyReport(rank, world)
    kwargs = factory_kwargs or {}
    torch.manual_seed(seed)
    model, batch_fn = _build(factory, kwargs)
    torch.manual_seed(seed)
    again, _ = _build(factory, kwargs)
    problem = _first_difference(model, again)
    # every rank must reach the same verdict (or the ranks that go on would wait for the others);
    # the verdicts travel on the mesh's device, which the group has a backend for (NCCL: cuda only)
    on_mesh = torch.device(mesh.device_type)
    other = _rank_difference(model, world, on_mesh)
    if problem is None and other is not None:
        problem = f"ranks built different initial parameters (the factory depends on the rank): {other}"
    flags = torch.tensor([problem is not None], dtype=torch.int32, device=on_mesh)
    dist.all_reduce(flags)
    if int(flags) and problem is None:
        problem = "another rank's two builds differed (see that rank's report)"
    if problem:
        report.problem = (
            f"the model factory is not deterministic: {problem}; build it from a seed so that "
            "two calls give the same parameters and buffers"
        )
        return report
    del again
    replica = copy.deepcopy(model)
    zerofx.compile(model, mesh, **options)
    report.sharded = any(isinstance(p, DTensor) for p in model.parameters())
    # the layers whose own checkpointing zerofx took over run without it in the replica too:
    # recomputing changes no value, though some models round otherwise with it on (NOTE: a
    # model's own layer checkpointing, zerofx/layer_checkpointing.py)
    take_over(replica, Options())
    opt = make_opt[optimizer](list(model.parameters()))
    ref = ShardedReference(replica, model, make_opt[optimizer])
    gen = torch.Generator().manual_seed(seed + 1)
    mine = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    for step in range(steps):
        batch = batch_fn(batch_per_rank * world, gen)
        _check_batch(batch)
        local = tuple(t[mine] if torch.is_tensor(t) and t.dim() else t for t in batch)
        loss = model(*local)
        loss.backward()
        ref_loss = ref.backward(lambda m: m(*local))
        s = StepReport(step, float(loss.detach()), float(ref_loss))
        d = exact_divergence(step, "loss", "loss", loss.detach(), ref_loss)
        if d is not None:
            s.divergences.append(d)
        ref.reduce_gradients()
        s.divergences += ref.check_gradients(model, step)
        s.bounded = list(ref.bounded)
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            s.divergences += ref.clip_grad_norm_(max_grad_norm, norm, step=step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.step()
        s.divergences += ref.check_parameters(model, step)
        report.steps.append(s)
    torch._dynamo.reset()
    return report


# options under which zerofx's training does other arithmetic than the unsharded fp32 reference
# (lower precision, quantized transfers): a bit-for-bit comparison would report their intended
# rounding as a divergence
_OTHER_ARITHMETIC = ("param_dtype", "reduce_dtype", "quantize_weights", "quantize_grads")


def _refuse_other_arithmetic(options: dict) -> None:
    """Refuse options whose training ``verify`` cannot compare bit for bit, on every rank alike
    (before any collective, so no rank waits for another)."""

    opts = Options(**options)
    changed = [
        f"{name}={getattr(opts, name)!r}"
        for name in _OTHER_ARITHMETIC
        if getattr(opts, name) not in (None, torch.float32)
    ]
    if changed:
        raise ValueError(
            f"zerofx.testing.verify compares against fp32 training bit for bit, and {', '.join(changed)} "
            "changes the arithmetic itself (lower precision or quantized transfers round by design); "
            "verify without it, and judge such a run by its loss curve against a plain run's, as "
            "benchmarks/zeropp.py does for quantized transfers"
        )


def verify_ranks(spec: str, world_size: int, **kwargs: Any) -> list[VerifyReport]:
    """``verify`` on ``world_size`` local gloo ranks started by torch's elastic launcher (what
    ``zerofx verify`` runs); each rank's report comes back."""
    from zerofx.launch import local_ranks

    return local_ranks(_verify_rank, world_size, spec, kwargs, name="zerofx-verify")


def _verify_rank(spec: str, kwargs: dict) -> dict:
    import datetime
    import os
    import sys

    if os.getcwd() not in sys.path:  # MODULE is found as the command line found it (zerofx/cli.py)
        sys.path.append(os.getcwd())

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        return verify(load_factory(spec), mesh, **kwargs).to_json()
    finally:
        dist.destroy_process_group()


def format_json_report(r: dict) -> str:
    """The text form of a ``VerifyReport.to_json()`` dict (what crosses the process boundary)."""
    rep = VerifyReport(r["rank"], r["world_size"], problem=r["problem"], sharded=r.get("sharded", True))
    for s in r["steps"]:
        step = StepReport(s["step"], s["loss"], s["ref_loss"], bounded=s["bounded"])
        step.divergences = [Divergence(**{**d, "index": tuple(d["index"])}) for d in s["divergences"]]
        rep.steps.append(step)
    return rep.format()


def dumps(reports: Iterable[dict]) -> str:
    return json.dumps(list(reports), indent=1, default=str)
