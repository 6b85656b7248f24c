"""offload: park chosen saved activations in host memory or on disk; page offloaded params out.

The checkpoint pass decides which saved values to offload and marks them in the joint graph
(``meta[OFFLOAD_TIER] = "host" | "disk"``); the partitioner copies that meta onto the
forward graph's saved outputs and the backward graph's matching inputs. This pass rewrites both
halves (ops in ``zerofx/ir/offload_ops.py``)::

    forward:   x = ...                          backward:  x_parked                (placeholder)
               ... last use of x ...                       ...
               p = zerofx.offload(x, tier, dir)            r = zerofx.reload(x_parked, ...)  <- early
               return (..., p, ...)                        ... compute the copy can hide behind ...
                                                           x = zerofx.reload_wait(r)         <- at use

The offload is issued right after the last forward use of ``x`` (or of any view sharing its
buffer), so the buffer is freed as soon as the copy has it. The reload is issued early enough
that, by the cost model's rates, the preceding backward compute covers the transfer; only the
wait sits at the first use. Values with symbolic shapes are left resident (the reload needs
static sizes).

When model state is offloaded (``offload_optimizer`` "disk" / "auto"), every graph also gets a
``zerofx.page_out(p)`` after the last read of each input (or of a view of it): a parameter
shard living in a memory-mapped file is read by its all-gather and dropped from resident memory
right after, even when it is also saved for the backward, which pages it in again to re-gather
(ZeRO-Infinity's parameter fetch). For any tensor not in a file the op does nothing.
"""

from __future__ import annotations

import torch
from torch import fx

from zerofx.ir.collectives import COLLECTIVE_OPS, WAIT
from zerofx.ir.meta import OFFLOAD_TIER, ROLE
from zerofx.ir.offload_ops import OFFLOAD, PAGE_OUT, RELOAD, RELOAD_WAIT
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import node_bytes, node_flops, storage_key
from zerofx.passes.graph import first_user, insert_call, positions

__all__ = ["offload_pass"]


def _static(val: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*val.shape, *val.stride()))


def _park_saved(gm: fx.GraphModule, ctx: PassContext) -> list[str]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if not isinstance(output.args[0], (list, tuple)):
        return []  # not a partitioned forward (those return user outputs + saved values)
    outs = list(output.args[0])
    n_user = ctx.num_fwd_outputs if ctx.num_fwd_outputs is not None else len(outs)
    order = positions(gm.graph)
    by_storage: dict = {}
    for n in gm.graph.nodes:
        if n.op != "output":
            by_storage.setdefault(storage_key(n), []).append(n)
    user_outputs = set(outs[:n_user])
    lines = []
    for i in range(n_user, len(outs)):
        node = outs[i]
        tier = node.meta.get(OFFLOAD_TIER) if isinstance(node, fx.Node) else None
        if tier is None:
            continue
        val = node.meta["val"]
        aliases = by_storage[storage_key(node)]
        if not _static(val) or any(a in user_outputs for a in aliases) or node.op == "placeholder":
            node.meta.pop(OFFLOAD_TIER, None)  # stays resident; the backward sees no mark
            continue
        readers = [u for a in aliases for u in a.users if u.op != "output"]
        last = max(readers + aliases, key=order.__getitem__)
        with gm.graph.inserting_after(last):
            parked = insert_call(gm, OFFLOAD, (node, tier, ctx.options.memory.offload_dir or ""), role="offload")
        parked.meta[OFFLOAD_TIER] = tier
        outs[i] = parked
        order = {n: j for j, n in enumerate(gm.graph.nodes)}
        lines.append(f"offload {node.name} -> {tier}: {node_bytes(node)} B, after its last forward use ({last.name})")
    output.args = (tuple(outs),)
    return lines


def _reload_saved(gm: fx.GraphModule, ctx: PassContext) -> list[str]:
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    lines = []
    for ph in placeholders:
        tier = ph.meta.get(OFFLOAD_TIER)
        if tier is None or not ph.users:
            continue
        val = ph.meta["val"]
        if not _static(val):
            continue
        first = first_user(ph)
        device = ctx.cost.device_for(val.device.type)
        need = device.transfer_s(node_bytes(ph), tier)
        # walk back from the first use until the compute in between covers the transfer
        issue_before, covered = first, 0.0
        cursor = first.prev
        while cursor.op != "placeholder" and cursor.op != "root" and covered < need:
            covered += device.compute_s(node_flops(cursor))
            issue_before = cursor
            cursor = cursor.prev
        original = val
        with gm.graph.inserting_before(issue_before):
            ph.meta["val"] = _parked_fake(original)
            started = insert_call(
                gm, RELOAD, (ph, tier, original.device, list(original.shape), list(original.stride())), role="offload"
            )
        with gm.graph.inserting_before(first):
            landed = insert_call(gm, RELOAD_WAIT, (started,), role="offload")
        for user in list(ph.users):
            if user is not started:
                user.replace_input_with(ph, landed)
        order = positions(gm.graph)
        ahead = order[landed] - order[started] - 1
        lines.append(
            f"reload {ph.name} <- {tier}: {node_bytes(ph)} B, issued {ahead} nodes before its first "
            f"use ({first.name}): ~{covered * 1e6:.1f} us of compute to hide ~{need * 1e6:.1f} us"
        )
    return lines


def _parked_fake(val: torch.Tensor) -> torch.Tensor:
    from torch._guards import detect_fake_mode

    with detect_fake_mode([val]) or torch._subclasses.FakeTensorMode():
        return torch.empty(val.shape, dtype=val.dtype, device="cpu")


def _page_out_inputs(gm: fx.GraphModule) -> int:
    """``page_out(x)`` after the last read of each input ``x`` or of any view of it."""
    order = positions(gm.graph)
    by_storage: dict = {}
    for n in gm.graph.nodes:
        if n.op != "output":
            by_storage.setdefault(storage_key(n), []).append(n)
    after: dict[fx.Node, fx.Node] = {}  # input -> the node after which it is paged out
    done: set = set()
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        key = storage_key(ph)
        if not isinstance(ph.meta.get("val"), torch.Tensor) or ph.meta.get(OFFLOAD_TIER) or key in done:
            continue
        done.add(key)
        readers = [u for a in by_storage[key] for u in a.users if u.op != "output"]
        # an asynchronous collective reads its input until its wait, not just when it is issued
        readers += [w for r in readers if r.target in COLLECTIVE_OPS for w in r.users if w.target is WAIT]
        if readers:  # a shard saved for the backward too: paged in again when the backward reads it
            after[ph] = max(readers, key=order.__getitem__)
    for ph, last in after.items():
        with gm.graph.inserting_after(last):
            node = gm.graph.call_function(PAGE_OUT, (ph,))
            node.meta["val"] = None
            node.meta[ROLE] = "offload"
    return len(after)


def offload_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Move marked saved activations out between forward and backward; page out offloaded params."""
    options = ctx.options.memory
    lines: list[str] = []
    if ctx.kind == "forward":
        lines = _park_saved(gm, ctx)
    elif ctx.kind == "backward":
        lines = _reload_saved(gm, ctx)
    for line in lines:
        ctx.report(line)
    if options.offload_optimizer in ("disk", "auto"):
        count = _page_out_inputs(gm)
        if count:
            ctx.report(f"page_out after the last use of {count} inputs (parameter shards in files leave memory)")
    return gm


PASS = Pass(
    "offload",
    offload_pass,
    kinds=("forward", "backward", "inference"),
    reads=(OFFLOAD_TIER,),
    writes=(OFFLOAD_TIER, ROLE),
)
