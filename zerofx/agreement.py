"""Before the first collective: every rank must shard the same model with the same options.

ZeRO's collectives pair up across ranks by order and size. A rank whose model has another width,
another depth, or whose options pick another stage, issues other collectives than its peers:
gloo then aborts the process with "Received data size doesn't match expected size", or, when
the sizes happen to fit, every rank waits forever for a collective its peer never issues (each
seen on 2 ranks with a GPT whose config differed by rank). The usual causes are a config read
from a per-rank file or environment, or options computed from the rank.

``check_ranks_agree`` runs where ``zerofx.shard`` starts, before any collective of its own:
each rank describes what it is about to shard (every parameter and buffer's name, shape, dtype
and ``requires_grad``, the meshes' shapes, the options), and the ranks of each mesh dimension
all-gather a 40-byte digest of that description, then all-reduce whether any group saw two
digests. When none did (the normal case: two tiny collectives per mesh dimension) nothing else
happens. Otherwise the first rank of each group that saw a difference broadcasts its
description and every rank raises a ``ZeroFXError``: a rank that differs names its first
difference from that rank, the others name the ranks that differ. Every rank raises, and only
after every rank has run every round, so none is left waiting in a collective.

Options that may differ by rank without changing any collective are left out of the
comparison: ``dump_dir``, ``offload_dir`` (a local disk per machine), ``host_memory_cap`` and
``verify``. A fake process group (``zerofx.plan``) has no peers to compare with and is skipped.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zerofx.errors import ZeroFXError
from zerofx.options import Options

__all__ = ["check_ranks_agree", "describe"]

# options a rank may set for itself: none of them changes what any collective moves
PER_RANK_OPTIONS = frozenset({"dump_dir", "offload_dir", "host_memory_cap", "verify"})
_DIGEST = 32  # sha256
_HEADER = _DIGEST + 8  # the digest, then the description's length in bytes


def has_gradient_hooks(p: torch.Tensor) -> bool:
    """Whether ``p`` has ``register_hook`` or ``register_post_accumulate_grad_hook`` hooks."""
    return bool(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))


def describe(model: nn.Module, meshes: list[DeviceMesh], options: Options) -> list[str]:
    """What must be the same on every rank, one line per item."""
    lines = [f"mesh of shape {tuple(mesh.shape)}" for mesh in meshes]
    place = options.shard_placement_fn
    for name, p in model.named_parameters():
        line = f"parameter {name}: shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"
        if place is not None:  # what it chooses, not where the function object lives
            line += f", shard_placement_fn gives {place(p)!r}"
        if has_gradient_hooks(p):
            line += ", gradient hooks"  # refused by sharding: on every rank alike (one rank's wandb.watch)
        lines.append(line)
    for name, b in model.named_buffers():
        lines.append(f"buffer {name}: shape {tuple(b.shape)}, {b.dtype}")
    for key in Options.keywords():
        if key not in PER_RANK_OPTIONS and key != "shard_placement_fn":
            lines.append(f"option {key}={getattr(options, key)!r}")
    return lines


def _first_difference(mine: list[str], theirs: list[str]) -> tuple[str, str]:
    """The first line (in order) where two descriptions part: (this rank's, the reference's)."""
    for a, b in zip(mine, theirs):
        if a != b:
            return a, b
    if len(mine) > len(theirs):
        return mine[len(theirs)], "nothing there (it ends before)"
    return "nothing there (it ends before)", theirs[len(mine)]


def check_ranks_agree(model: nn.Module, meshes: list[DeviceMesh], options: Options) -> None:
    """Raise on every rank of ``meshes`` (the data-parallel mesh, and the tensor-parallel one if
    any) unless all of them describe the same model and options (module docstring).

    Collectives over each dimension's group, in three rounds that every rank runs in full before
    any raises, so that no rank is left waiting in a group whose other members raised: the
    digests (an all-gather per group); whether any group saw a difference (a max all-reduce per
    group, which over a grid of groups reaches every rank); then, only where digests differed,
    the group's first rank broadcasts its description."""
    groups = [(mesh, dim) for mesh in meshes for dim in range(mesh.ndim) if mesh.size(dim) > 1]
    if not groups or any(dist.get_backend(mesh.get_group(dim)) == "fake" for mesh, dim in groups):
        return
    lines = describe(model, meshes, options)
    blob = "\n".join(lines).encode()
    header = hashlib.sha256(blob).digest() + len(blob).to_bytes(8, "little")
    device = torch.device(meshes[0].device_type)
    mine = torch.tensor(list(header), dtype=torch.uint8, device=device)
    split: list[tuple[DeviceMesh, int, list[bytes]]] = []  # the groups whose digests differ
    for mesh, dim in groups:
        rows = [torch.empty_like(mine) for _ in range(mesh.size(dim))]
        dist.all_gather(rows, mine, group=mesh.get_group(dim))
        headers = [bytes(r.cpu().tolist()) for r in rows]
        if len(set(headers)) > 1:
            split.append((mesh, dim, headers))
    anywhere = torch.tensor([1 if split else 0], dtype=torch.int32, device=device)
    for mesh, dim in groups:
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if not anywhere.item():
        return
    here, problems = dist.get_rank(), []
    for mesh, dim, headers in split:
        group = mesh.get_group(dim)
        ranks = dist.get_process_group_ranks(group)
        differing = [ranks[i] for i, h in enumerate(headers) if h[:_DIGEST] != headers[0][:_DIGEST]]
        if mesh.get_local_rank(dim) == 0:
            reference = torch.tensor(list(blob), dtype=torch.uint8, device=device)
        else:
            reference = torch.empty(int.from_bytes(headers[0][_DIGEST:], "little"), dtype=torch.uint8, device=device)
        dist.broadcast(reference, group=group, group_src=0)
        if here in differing:
            ours, theirs = _first_difference(lines, bytes(reference.cpu().tolist()).decode().split("\n"))
            problems.append(
                f"this rank ({here}) differs from rank {ranks[0]} (ranks that differ from it: {differing}). "
                f"Here: {ours}; on rank {ranks[0]}: {theirs}"
            )
        else:
            problems.append(f"rank(s) {differing} shard another model or options than rank {ranks[0]}")
    raise ZeroFXError(
        "every rank must shard the same model with the same options, but "
        + ("; ".join(problems) if problems else "ranks of another group differ (their errors say how)")
        + ". zerofx stops on every rank instead of waiting in a collective the ranks would never match; "
        "the usual cause is a model config or option that depends on the rank"
    )
