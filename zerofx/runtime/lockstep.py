"""Before each compiled graph that communicates: are all ranks about to issue the same collectives?

ZeRO's collectives pair up across ranks by order alone. When ranks run different graphs, each
rank's next collective meets another one on its peer: gloo aborts the process ("Received data
size doesn't match expected size"), NCCL waits until its watchdog kills the job, and where the
sizes happen to match, each rank goes on with another parameter's rows, silently. The usual
cause is Python control flow that depends on the data: a mixture-of-experts layer that skips the
experts no token of this rank was routed to (dynamo breaks the graph at such a branch, so each
rank runs the graphs of the experts it uses), or a branch on the rank itself.
``zerofx.agreement`` proves once, at ``zerofx.shard``, that every rank holds the same model;
this check covers what the ranks run afterwards.

Each compiled graph that issues collectives carries a digest of them (their kinds, byte counts,
process-group dimensions, and the parameters its frame reads, by name: two experts of one shape
gather the same bytes). Before the graph runs, the ranks all-reduce their 56-bit digests (the
largest, and the largest negated) over one group that spans every rank of the model's meshes.
When they differ, every rank all-gathers
its description of the graph it was about to run and raises a ``ZeroFXError`` naming what each
rank was about to run, before any of those collectives is issued: no rank is left waiting.
Ranks that agree on every graph run the same collectives, so nothing else is checked.

Cost: one small blocking all-reduce per graph run (two per step for a model without graph
breaks); ``Options(check_lockstep=False)`` turns it off. The group is the default one when it
takes CPU tensors (gloo), else a gloo group over the same ranks, made once by ``make_lockstep``
where ``zerofx.shard`` runs (every rank of the meshes calls it there), so the check never
synchronizes with an accelerator stream.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerofx.errors import ZeroFXError

__all__ = ["Lockstep", "make_lockstep", "digest_of"]


def digest_of(*parts: Any) -> int:
    """The same 56 bits on every rank for the same parts (Python's hash is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


@dataclass(eq=False)
class Lockstep:
    """The group the per-graph check runs on (None: the default group) and its size."""

    group: Any
    size: int

    def check(self, digest: int, describe: Callable[[], str]) -> None:
        """Raise on every rank unless every rank of the group passes the same ``digest`` (at most
        56 bits, so that it negates). ``describe()`` says what this rank was about to run (only
        called when they differ)."""
        # the largest digest and the largest negated one: all equal when the largest is the
        # smallest (one all-reduce costs two thirds of an all-gather's time on gloo)
        bounds = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)
        if int(bounds[0]) == -int(bounds[1]):
            return
        # every rank saw the same bounds, so every rank is here: one more exchange, then all raise
        described: list[Any] = [None] * self.size
        dist.all_gather_object(described, describe(), group=self.group)
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.size))
        kinds: dict[str, list[int]] = {}
        for rank, text in zip(ranks, described):
            kinds.setdefault(text, []).append(rank)
        lines = "; ".join(f"rank(s) {rs}: {text}" for text, rs in kinds.items())
        raise ZeroFXError(
            "the ranks are about to run different compiled graphs, whose collectives would not pair up (gloo "
            f"aborts, NCCL waits forever, or each rank silently takes another parameter's rows): {lines}. "
            "This usually means Python control flow that depends on the data or on the rank, such as a "
            "mixture-of-experts layer that skips the experts no token of this rank was routed to. Every rank "
            "must read the same parameters in the same order: run every expert (an empty batch costs little), "
            "or use a batched experts implementation (transformers: experts_implementation='grouped_mm'); "
            "stage=1 gathers nothing in its graphs and reduces every rank's gradients together"
        )

    @torch.no_grad()
    def pend_everywhere(self, states: list) -> None:
        """Before the accumulation boundary's reduce (a collective over the parameters with a
        pending local gradient): give a zero pending gradient to every parameter that another
        rank has one for, so that every rank reduces the same parameters. A parameter a rank did
        not use this time (an expert no token was routed to) then averages its users'
        gradients with zeros, as DDP's ``find_unused_parameters`` does."""
        here = torch.tensor([s.sink.grad is not None for s in states], dtype=torch.uint8)
        dist.all_reduce(here, op=dist.ReduceOp.MAX, group=self.group)
        for s, anywhere in zip(states, here.tolist()):
            if anywhere and s.sink.grad is None:
                s.sink.grad = torch.zeros(s.sink.shape, dtype=s.sink.dtype, device=s.sink.device)


def make_lockstep(meshes: list) -> Lockstep | None:
    """The check's group for a model sharded over ``meshes``; None when there is nothing to
    check (one rank, or a fake process group). Every rank of the meshes calls this together."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks: set[int] = set()
    for mesh in meshes:
        root = mesh._get_root_mesh()  # a TP or DP submesh: every rank of the mesh it was cut from
        ranks.update(int(r) for r in root.mesh.flatten().tolist())
    if len(ranks) < 2 or any(
        dist.get_backend(mesh.get_group(d)) == "fake" for mesh in meshes for d in range(mesh.ndim)
    ):
        return None
    world = dist.get_world_size()
    if ranks == set(range(world)) and "gloo" in str(dist.get_backend()):
        return Lockstep(None, world)
    members = sorted(ranks)
    return Lockstep(dist.new_group(members, backend="gloo", use_local_synchronization=True), len(members))
