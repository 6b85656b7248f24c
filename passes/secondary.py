"""secondary: hpZ (ZeRO++ hierarchical partitioning), the backward re-gathers inside the inner
mesh dimension only.

With ``Options.secondary_shard`` on a 2-D mesh ``(replicate, shard)``, parameters are sharded
over the whole mesh (zerofx/sharding.py, NOTE: hpZ) and their ``unshard`` markers name the inner
dimension's group (``secondary_size``, ``secondary_name``). The work is split in two, because
the partitioner decides what crosses from forward to backward and would undo anything the joint
graph only asks for (a "keep these rows" node marked MUST_SAVE in the joint graph was moved into
the backward by torch's min-cut partitioner, which then re-gathered over the whole mesh anyway):

* the pass (joint graph) tags every such marker (not one selective unsharding keeps whole) with
  ``zerofx_secondary``: (id, inner size, inner group, first row, rows) of this rank's secondary
  shard, one id per parameter. Every one, also a marker the backward never reads: torch's
  partitioner merges equal markers (a tied weight read through two views, by an embedding and
  by the LM head), and whichever it keeps must carry the tag. The partitioner copies the tag onto
  the forward's marker and onto the backward's recomputed copy of it. Disabling the pass
  (``disable_passes=("secondary",)``) leaves nothing tagged: the backward re-gathers over the
  whole mesh, as plain ZeRO-3 does;
* ``split_secondary`` runs in the backend's ``partition()`` on the (forward, backward) pair
  torch's partitioner returned, where nothing can move it again::

    forward:   full = zerofx.unshard(shard, W, g_world, R, ..., S, g_inner)   # over the whole mesh
               part = aten.slice(full, 0, off, off + rows)                  # this rank's inner rows
               hpz_secondary_0 = aten.clone(part)                            # saved for backward
               return (*outputs, hpz_secondary_0, *saved)                    # first saved tensor
    backward:  (*symints, hpz_secondary_0, *saved, *tangents)                # matching placeholder
               full = zerofx.unshard(hpz_secondary_0, S, g_inner, R)         # role secondary_gather

  AOTAutograd (torch 2.13, _aot_autograd/graph_compile.py ``_categorize_saved_tensors_for_backward``)
  counts the saved values from the forward graph's outputs after ``partition()`` returns; saved
  tensors come first among them and, in the backward, after the saved symints, so the new value
  goes first in both. The gather pass lowers the backward marker to an all-gather over the inner
  group (``zerofx.ir.layout``'s chunking of ``R`` rows over ``S``: ``off``/``rows`` above), which
  bucket, schedule and transport (gloo's ``out=`` form) then treat like any other.

Values: the secondary shard is a copy of what the forward computed with, in the compute dtype, so
the backward reads the same weights as without hpZ, bit for bit. Under qwZ (``quantize_weights``)
the forward's gather is quantized and the secondary shard holds its dequantized values; the
inner all-gather is left unquantized (role ``secondary_gather``, which the quantize pass skips),
so the backward still reads exactly the forward's weights (requantizing dequantized values in
other blocks is not exact). DeepSpeed's hpZ keeps its secondary copy in the parameter dtype too
and quantizes the intra-node gather; here the outer-dimension bytes are the same and the inner
ones full width. Gradients are unchanged: the forward marker's autograd, a reduce-scatter over
the whole mesh.

Price: ``rows/R`` of every re-gathered parameter in the compute dtype, held from forward to
backward: the forward's saved activations (the backend notes them, and its memory estimates
count them as saved values).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import fx

from zerofx.ir.layout import local_rows, row_offset
from zerofx.ir.markers import UNSHARD
from zerofx.ir.meta import PASS as PROVENANCE
from zerofx.ir.meta import ROLE, SECONDARY
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import tensor_bytes
from zerofx.passes.graph import first_user, full_args, insert_call, is_view
from zerofx.passes.regather import backward_nodes, chain_of

__all__ = ["Secondary", "secondary_pass", "split_secondary", "PASS"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Secondary:
    """This rank's secondary shard of one gathered parameter (the tag ``zerofx_secondary``)."""

    id: int
    size: int  # the inner dimension's group size
    group: str  # and name
    first_row: int
    rows: int


def _group_rank(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).rank()


def _root(node: fx.Node) -> fx.Node:
    while is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def secondary_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """hpZ: tag the gathered parameters the backward re-gathers, so the backend's partition keeps
    this rank's inner-dimension rows of each for a backward all-gather inside that dimension."""
    backward = backward_nodes(gm.graph)
    ids: dict[tuple, int] = {}
    held = 0
    for marker in [n for n in gm.graph.nodes if n.target is UNSHARD and n not in backward]:
        args = full_args(marker)
        size, group, full_rows = args[6], args[7], args[3]
        if not size or marker.meta.get(ROLE) == "kept_gather":
            continue
        # Every marker is tagged, also one the backward does not read (an embedding's): torch's
        # partitioner merges equal markers (a tied weight read through two views), and the one it
        # keeps must carry the tag. One id per parameter: the shard's views resolved.
        key = (_root(args[0]), *args[1:])
        rank = _group_rank(group)
        if key not in ids:
            ids[key] = len(ids)
        if any(u in backward for n in chain_of(marker) for u in n.users):
            held += tensor_bytes(marker.meta["val"]) * local_rows(full_rows, size, rank) // full_rows
        marker.meta[SECONDARY] = Secondary(
            ids[key], size, group, row_offset(full_rows, size, rank), local_rows(full_rows, size, rank)
        )
    if ids:
        ctx.report(
            f"hpZ: tagged the markers of {len(ids)} gathered parameters; those the backward re-gathers keep a "
            f"secondary shard for a re-gather inside the inner dimension, about {held} B held from forward to "
            "backward (split in the partition)"
        )
    return gm


def _secondary_markers(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    found: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.target is UNSHARD and isinstance(node.meta.get(SECONDARY), Secondary):
            found.setdefault(node.meta[SECONDARY].id, []).append(node)
    return found


def _stamp(node: fx.Node, role: str) -> fx.Node:
    node.meta[PROVENANCE.name] = "secondary"
    node.meta[ROLE] = role
    return node


def _erase_dead_views(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and the views feeding it once nothing reads them (the old re-gather's input)."""
    while node.op == "call_function" and not node.users and is_view(node):
        source = node.args[0]
        gm.graph.erase_node(node)
        if not isinstance(source, fx.Node):
            return
        node = source


def split_secondary(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> list[tuple[str, int]]:
    """Move hpZ's secondary shards across the partition (see the module docstring): each tagged
    forward marker gets ``hpz_secondary_<id>``, a saved output; each tagged backward marker is
    replaced by a gather of the matching placeholder over the inner group. Returns the saved
    values' names and bytes; nothing changes when nothing is tagged."""
    from torch._functorch.partitioners import is_sym_node

    fw_markers, bw_markers = _secondary_markers(fw), _secondary_markers(bw)
    common = sorted(set(fw_markers) & set(bw_markers))
    if not common:
        return []
    output = fw.graph.output_node()
    outs = list(output.args[0])
    saved = outs[num_fwd_outputs:]
    leading_syms = sum(1 for n in saved if isinstance(n, fx.Node) and is_sym_node(n))
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    first_saved_tensor = placeholders[leading_syms]
    added: list[tuple[str, int]] = []
    new_outs = []
    for sid in common:
        marker = fw_markers[sid][0]
        sec: Secondary = marker.meta[SECONDARY]
        with fw.graph.inserting_before(first_user(marker)):
            part = _stamp(
                insert_call(fw, aten.slice.Tensor, (marker, 0, sec.first_row, sec.first_row + sec.rows)),
                "secondary",
            )
            kept = insert_call(fw, aten.clone.default, (part,))
        kept._rename(f"hpz_secondary_{sid}")
        _stamp(kept, "secondary")
        new_outs.append(kept)
        with bw.graph.inserting_before(first_saved_tensor):
            placeholder = bw.graph.placeholder(kept.name)
        placeholder.meta["val"] = kept.meta["val"]
        _stamp(placeholder, "secondary")
        for old in bw_markers[sid]:
            full_rows = full_args(old)[3]
            with bw.graph.inserting_before(old):
                new = insert_call(bw, UNSHARD, (placeholder, sec.size, sec.group, full_rows))
            _stamp(new, "secondary_gather")
            old.replace_all_uses_with(new)
            source = old.args[0]
            bw.graph.erase_node(old)
            if isinstance(source, fx.Node):
                _erase_dead_views(bw, source)
        added.append((kept.name, tensor_bytes(kept.meta["val"])))
    output.args = (tuple(outs[:num_fwd_outputs] + new_outs + saved),)
    descs = output.meta.get("desc")
    if isinstance(descs, list) and len(descs) == len(outs):  # torch's names for the outputs, renumbered
        from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

        k = len(new_outs)
        shifted = [
            dataclasses.replace(d, idx=d.idx + k) if isinstance(getattr(d, "idx", None), int) else d
            for d in descs[num_fwd_outputs:]
        ]
        output.meta["desc"] = [*descs[:num_fwd_outputs], *map(SavedForBackwardsAOTOutput, range(k)), *shifted]
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()
    return added


PASS = Pass("secondary", secondary_pass, kinds=("joint",), reads=(ROLE,), writes=(ROLE, SECONDARY))
