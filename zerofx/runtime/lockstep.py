"""Before each collective the ranks could issue out of order: are all ranks about to issue the same?

ZeRO's collectives pair up across ranks by order alone. When ranks run different graphs, each
rank's next collective meets another one on its peer: gloo aborts the process ("Received data
size doesn't match expected size"), NCCL waits until its watchdog kills the job, and where the
sizes happen to match, each rank goes on with another parameter's rows, silently. The usual
cause is Python control flow that depends on the data: a mixture-of-experts layer that skips the
experts no token of this rank was routed to (dynamo breaks the graph at such a branch, so each
rank runs the graphs of the experts it uses), or a branch on the rank itself.
``zerofx.agreement`` proves once, at ``zerofx.shard``, that every rank holds the same model;
this module covers what the ranks run afterwards:

- each compiled graph that communicates, or whose backward may (stage 2 reads whole copies in
  forward and reduce-scatters in backward), carries a digest: the kinds of its collectives,
  their mesh dimensions and wire dtypes (not their bytes, which a tensor-parallel plan's
  activations may vary between data-parallel ranks), and for a forward the parameters this call
  was given, by name (two experts of one shape gather the same bytes). Before the graph runs,
  the ranks all-reduce their 56-bit digests (the largest, and the largest negated) over the
  groups of the model's meshes. When they differ, every rank all-gathers its description of
  what it was about to run and raises a ``ZeroFXError`` naming what each rank would run,
  before any of those collectives is issued: no rank is left waiting. A frame that reads the
  parameters of several sharded models (a teacher and a student in one compiled function)
  checks over the groups of every one of them (``merge``). An uncompiled model
  gathers read by read, so each read that communicates is checked the same way
  (``ParamState.check_uncompiled_read``; a read that does not, such as logging a stage-2
  weight's norm on one rank, is not);
- the accumulation boundary's reduce (stage 1, and after ``no_sync``) covers the parameters
  with a pending gradient, which differ by rank when a rank did not use a parameter: it first
  agrees, over the meshes' own groups, on every parameter any rank has one for
  (``pend_everywhere``).

Cost: one small blocking all-reduce per checked graph run (two per step for a model without
graph breaks; four per check on a 2-D mesh: each dimension compares, then whether any differed
goes through each; a frame reading models over k groups in all: k + k^2, see ``merge``), one per
uncompiled read that communicates, and one per accumulation boundary. ``Options(check_lockstep=False)`` turns the checks off (not the boundary's agreement:
it is what makes such a model correct at stage 1). The checks run on the meshes' own groups
where they take CPU tensors (gloo), else on gloo groups over the same ranks, made by
``make_lockstep`` where ``zerofx.shard`` runs (every rank of the meshes calls it there) and only
when the checks are on, once per group for every model sharded over it, so they never
synchronize with an accelerator stream.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerofx.errors import ZeroFXError

__all__ = ["Lockstep", "make_lockstep", "digest_of", "merge"]


def digest_of(*parts: Any) -> int:
    """The same 56 bits on every rank for the same parts (Python's hash is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


@dataclass(eq=False)
class Lockstep:
    """The groups the checks run on: one per dimension (of more than one rank) of the meshes the
    model was sharded over, each taking CPU tensors. Over a grid of groups, a maximum taken in
    every dimension in turn reaches every rank (as ``zerofx.agreement``'s rounds do). Not one
    group over every rank of the root mesh: ranks outside the model's own groups may run other
    models (the stages of a pipeline, each sharded over its own data-parallel mesh)."""

    mesh_groups: list  # the meshes' own groups (any backend): the boundary's agreement
    device: torch.device  # the meshes' device, for tensors on ``mesh_groups``
    groups: list | None  # the same ranks, taking CPU tensors: the checks (None: check_lockstep=False)
    spread_passes: int = 1  # passes that carry "they differ" over the groups: 1 for one model's grid (merge)

    def __deepcopy__(self, memo: dict) -> Lockstep:
        return self  # process groups are the process's, shared by every copy of the model

    def _max_everywhere(self, values: torch.Tensor, groups: list | None = None) -> torch.Tensor:
        for group in self.groups if groups is None else groups:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        return values

    def check(self, digest: int, describe: Callable[[], str]) -> None:
        """Raise on every rank unless every rank passes the same ``digest`` (at most 56 bits, so
        that it negates). ``describe()`` says what this rank was about to run (only called when
        they differ)."""
        # the largest digest and the largest negated one: all equal when the largest is the
        # smallest (one all-reduce costs two thirds of an all-gather's time on gloo)
        assert self.groups is not None, "lockstep checks were turned off (check_lockstep=False)"
        if len(self.groups) == 1:
            bounds = self._max_everywhere(torch.tensor([digest, -digest], dtype=torch.int64))
            if int(bounds[0]) == -int(bounds[1]):
                return
        else:  # each dimension's groups compare, then whether any differed reaches every rank
            differ = 0
            for group in self.groups:
                bounds = torch.tensor([digest, -digest], dtype=torch.int64)
                dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
                differ |= int(bounds[0]) != -int(bounds[1])
            flag = torch.tensor([differ], dtype=torch.uint8)
            for _ in range(self.spread_passes):
                self._max_everywhere(flag)
            if not int(flag):
                return
        # every rank knows they differ, so every rank is here: one more exchange, then all raise
        lines = []
        for group in self.groups:
            described: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(described, describe(), group=group)
            kinds: dict[str, list[int]] = {}
            for rank, text in zip(dist.get_process_group_ranks(group), described):
                kinds.setdefault(text, []).append(rank)
            if len(kinds) > 1:
                lines.append("; ".join(f"rank(s) {rs}: {text}" for text, rs in kinds.items()))
        raise ZeroFXError(
            "the ranks are about to issue different collectives, which would not pair up (gloo aborts, NCCL "
            "waits forever, or each rank silently takes another parameter's rows): "
            + (" / ".join(lines) if lines else "ranks of another group differ (their errors say how)")
            + ". This usually means Python control flow that depends on the data or on the rank: a model "
            "run on some ranks only (an evaluation or generation under `if rank == 0:` gathers parameters "
            "that the other ranks never send: run it on every rank, or on a model of its own, such as one "
            "loaded from zerofx.checkpoint.export_full_state_dict); a graph break on some ranks only (a "
            "print, .item() or logging under `if rank == 0:` inside the forward ends that rank's graph early, "
            "so its graphs read the same parameters in other pieces: log outside the forward, or on every "
            "rank); or a "
            "mixture-of-experts layer that skips the experts no token of this rank was routed to. Every rank "
            "must read the same parameters in the same order: run every expert (an empty batch costs little), "
            "or use a batched experts implementation (transformers: experts_implementation='grouped_mm'); "
            "stage=1 gathers nothing in its graphs and reduces every rank's gradients together"
        )

    @torch.no_grad()
    def any_everywhere(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank of the meshes' own groups (a collective of them):
        for a decision that would otherwise be each rank's own, before a collective it decides."""
        value = torch.tensor([int(flag)], dtype=torch.uint8, device=self.device)
        return bool(self._max_everywhere(value, self.mesh_groups).item())

    @torch.no_grad()
    def pend_everywhere(self, states: list) -> None:
        """Before the accumulation boundary's reduce (a collective over the parameters with a
        pending local gradient): give a zero pending gradient to every parameter that another
        rank has one for, so that every rank reduces the same parameters. A parameter a rank did
        not use this time (an expert no token was routed to) then averages its users'
        gradients with zeros, as DDP's ``find_unused_parameters`` does."""
        here = torch.tensor([s.sink.grad is not None for s in states], dtype=torch.uint8, device=self.device)
        here = self._max_everywhere(here, self.mesh_groups)
        for s, anywhere in zip(states, here.tolist()):
            if anywhere and s.sink.grad is None:
                s.sink.grad = torch.zeros(s.sink.shape, dtype=s.sink.dtype, device=s.sink.device)


def merge(locksteps: list[Lockstep]) -> Lockstep | None:
    """The checks of one compiled frame that reads the parameters of several sharded models:
    every check group of each, so that ranks that agree within one model's groups but not
    within another's still stop (a frame reading a model sharded over pairs of ranks, then one
    sharded over every rank). None when no model checks.

    The groups are put in one order over all groups, the same on every rank whatever order the
    frame's inputs came in (rank-dependent control flow may call the models in another order on
    another rank): smaller groups first, then by their ranks, one group per set of ranks (the
    first by name: two models' gloo twins over the same ranks are interchangeable, and names are
    given in the same order on every rank). Every rank meets each pair of its groups in the same
    order, so no two ranks wait in each other's groups. That order mixes the models' mesh
    dimensions, so one pass of "they differ" over the groups no longer reaches every rank of a
    grid (three dimensions crossing: two models over 2x2 and over the third 2); each pass carries
    it at least one group further, so the spread repeats once per group (more all-reduces, for
    frames that read several models only). Ranks whose frames read different sets of models still build
    different lists, as they would pick different models' groups without this: their checks
    then meet in no group, and wait until the process group's timeout (not covered).
    ``mesh_groups`` stays empty: the merged checks serve a frame, never the accumulation
    boundary's agreement."""
    checking = [lock for lock in locksteps if lock.groups is not None]
    if len({id(lock) for lock in checking}) <= 1:
        return checking[0] if checking else None
    by_ranks: dict[tuple[int, ...], Any] = {}
    for group in sorted((g for lock in checking for g in lock.groups), key=lambda g: g.group_name):
        by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), group)
    ordered = [by_ranks[ranks] for ranks in sorted(by_ranks, key=lambda ranks: (len(ranks), ranks))]
    return Lockstep([], checking[0].device, ordered, spread_passes=len(ordered))


def make_lockstep(meshes: list, checks: bool = True) -> Lockstep | None:
    """The groups for a model sharded over ``meshes`` (the data-parallel mesh, and the
    tensor-parallel one if any); None when there is nothing to agree on (one rank, or a fake
    process group). ``checks``: also the groups the lockstep checks run on (gloo twins of NCCL
    groups, made only then). Every rank of the meshes calls this together."""
    dims = [mesh.get_group(d) for mesh in meshes for d in range(mesh.ndim) if mesh.size(d) > 1]
    if not dims or any(dist.get_backend(g) == "fake" for g in dims):
        return None
    groups = None
    if checks:
        groups = []
        for group in dims:
            if "gloo" in str(dist.get_backend(group)):  # takes CPU tensors
                groups.append(group)
            else:  # NCCL: a gloo group over the same ranks, so that no check waits on a stream
                groups.append(_gloo_twin(group))
    return Lockstep(dims, torch.device(meshes[0].device_type), groups)


# the gloo twin of each NCCL group, by the group's id: (the group, its twin). Every model sharded
# over one mesh shares one twin instead of opening another set of connections per zerofx.shard
# (a sweep compiling many models in one process would otherwise run out of sockets and threads)
_TWINS: dict[int, tuple[Any, Any]] = {}
_TWINS_LOCK = threading.Lock()


def _registered(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
        return True
    except KeyError:  # destroyed (``destroy_process_group`` of it, or of every group)
        return False


def _gloo_twin(group: Any) -> Any:
    """A gloo group over ``group``'s ranks, made once per group (a collective of those ranks the
    first time: all of them make it together, so all of them find it afterwards). When a group
    is destroyed, its twin is destroyed with it at the next call (a local operation on gloo), so
    neither its connections nor its name outlive the group."""
    with _TWINS_LOCK:
        for key, (owner, twin) in list(_TWINS.items()):
            if not _registered(owner):
                if _registered(twin):
                    dist.destroy_process_group(twin)
                del _TWINS[key]
        cached = _TWINS.get(id(group))
        if cached is not None and cached[0] is group:
            return cached[1]
        twin = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)
        _TWINS[id(group)] = (group, twin)
        return twin
