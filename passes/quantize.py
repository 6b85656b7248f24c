"""quantize: move block-quantized bytes instead of floats (ZeRO++'s qwZ and qgZ).

Runs after bucket and schedule, so it rewrites each collective they merged and placed, where
they placed it (the quantize sits right before the issue, the dequantize right after the
wait), and before transport, which then moves the rewritten collectives like any other (on gloo:
the ``out=`` all-gather, NOTE: gloo all-gathers in flight). Wire format: zerofx/ir/quantize.py
(NOTE: packed rows: payload and fp32 scales in one uint8 buffer, one collective).

qwZ (``quantize_weights="int8"``), each parameter all-gather (stage 3, forward and backward)::

    ag = all_gather_into_tensor(x, N, group);  w = wait_tensor(ag)
  becomes
    q  = zerofx.quantize_blockwise(x, 1, block, 8)         # uint8 [1, L]: this rank's row
    ag = all_gather_into_tensor(view(q, [L]), N, group)     # N·L bytes instead of N·|x|
    w  = wait_tensor(ag);  d = zerofx.dequantize_blockwise(view(w, [N, L]), |x|, block, 8, dtype)
    out = view(d, shape of the old gather)

In a bucket, the row is every member's shard end to end, and each member's values are
quantized in blocks of their own (``BUCKET_SEGMENTS``, zerofx/ir/quantize.py NOTE: segments);
the same for each destination's chunk of a bucketed reduce-scatter below.

The gradient does not see any of this: AOTAutograd differentiated the ``unshard`` marker before
the passes ran, so its backward is the same reduce-scatter into the fp32 shard (a
straight-through estimator: only the gathered values are rounded).

qgZ (``quantize_grads="int8" | "int4"``), each gradient reduce-scatter (``N`` chunks)::

    q  = zerofx.quantize_blockwise(g, N, block, bits)       # each destination's chunk on its own
    a  = all_to_all_single(view(q, [N·L]), [L]*N, [L]*N, group)     # counted as a reduce-scatter
    d  = zerofx.dequantize_blockwise(view(wait(a), [N, L]), |g|/N, block, bits, fp32)
    s  = d[0] + d[1] + ... (/ N for avg)                     # in fp32, rank order; then the old dtype

and each gradient all-reduce (the outer dimension of a 2-D mesh, whole parameters) becomes the
same all-to-all reduce-scatter over chunks of the flattened gradient, then its fp32 chunk
requantized and all-gathered (the second hop); every rank, its own chunk included, takes the
dequantized gathered values, so replicas stay bit-identical. No reduction runs in low
precision; there is no error feedback (quantization error is unbiased in expectation only with
stochastic rounding, which is not implemented: the convergence runs in benchmarks/zeropp.py
show whether it is needed).

The pass reports, per graph, what went on the wire before and after and the cost model's price:
communication time saved against the quantize/dequantize compute it added.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import fx

from zerofx.ir.collectives import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_OPS,
    REDUCE_SCATTER,
    WAIT,
    collective_group_size,
    wire_bytes,
)
from zerofx.ir.meta import BUCKET_SEGMENTS, COLLECTIVE, QUANTIZED, ROLE
from zerofx.ir.quantize import DEQUANTIZE, QUANTIZE, QuantFormat, quant_format
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import tensor_bytes
from zerofx.passes.graph import CONVERT, insert_call
from zerofx.passes.transport import rank_ordered_sum

aten = torch.ops.aten


class _Tally:
    """Wire bytes before and after, and the nodes added (priced at the end)."""

    def __init__(self) -> None:
        self.count = 0
        self.before = 0
        self.after = 0
        self.compute: list[fx.Node] = []


def _mark(node: fx.Node, fmt: QuantFormat, dtype: torch.dtype, before: int, tally: _Tally, *, hop: int = 0) -> None:
    """Record on a quantized collective what it replaced (the dump and the counters read it)."""
    spec = COLLECTIVE_OPS[node.target]
    sized = node if spec.sized == "out" else node.args[0]
    kind = node.meta.get(COLLECTIVE) or spec.kind
    after = wire_bytes(kind, tensor_bytes(sized.meta["val"]), collective_group_size(spec, node.args))
    node.meta[QUANTIZED] = (fmt.describe(), str(dtype).replace("torch.", ""), before)
    tally.count += hop == 0  # a quantized all-reduce's second hop is the same reduction
    tally.before += before
    tally.after += after


def _waits(collective: fx.Node) -> list[fx.Node] | None:
    waits = [u for u in collective.users if u.target is WAIT]
    return waits if waits and len(waits) == len(collective.users) else None


def _quantize(
    gm: fx.GraphModule, x: fx.Node, rows: int, fmt: QuantFormat, role: str, tally: _Tally, segments=None
) -> fx.Node:
    """Insert ``quantize_blockwise(x)`` flattened to ``[rows · L]`` bytes (at the insertion point);
    ``segments``: the bucket's pieces of a row, each quantized in blocks of its own."""
    q = insert_call(gm, QUANTIZE, (x, rows, fmt.block, fmt.bits, fmt.floating, segments), role=role)
    tally.compute.append(q)
    return insert_call(gm, aten.view.default, (q, [q.meta["val"].numel()]), role=role)


def _dequantize(
    gm: fx.GraphModule,
    flat: fx.Node,
    rows: int,
    numel: int,
    fmt: QuantFormat,
    dtype,
    role: str,
    tally: _Tally,
    segments=None,
) -> fx.Node:
    """Insert the ``[rows, numel]`` values of ``rows`` packed rows held flat in ``flat``."""
    packed = insert_call(gm, aten.view.default, (flat, [rows, flat.meta["val"].numel() // rows]), role=role)
    out = insert_call(gm, DEQUANTIZE, (packed, numel, fmt.block, fmt.bits, dtype, fmt.floating, segments), role=role)
    tally.compute.append(out)
    return out


def _staged_input(gm: fx.GraphModule, ag: fx.Node) -> fx.Node:
    """What an all-gather sends. The bucket pass (torch's bucketing) gathers in place: it copies
    the bucket's flat input into this rank's slice of the ``out=`` buffer and sends that slice;
    a quantized gather sends bytes instead, so the copy and the float buffer go, and the flat
    input itself is quantized."""
    inp = ag.args[0]
    out = ag.kwargs.get("out")
    if out is None or inp.target is not aten.copy_.default or len(inp.users) != 1:
        return inp
    dst, src = inp.args[:2]
    if not (isinstance(dst, fx.Node) and dst.args and dst.args[0] is out and len(dst.users) == 1):
        return inp
    dtype = out.meta["val"].dtype
    if src.meta["val"].dtype != dtype:  # torch's surgery folds a cast into the copy: keep it
        with gm.graph.inserting_before(ag):
            src = insert_call(gm, CONVERT, (src, dtype), role=ag.meta.get(ROLE, "gather"))
    ag.kwargs = {}
    ag.args = (src, *ag.args[1:])
    for dead in (inp, dst, out):
        if not dead.users:
            gm.graph.erase_node(dead)
    return src


def _gather(gm: fx.GraphModule, ag: fx.Node, fmt: QuantFormat, tally: _Tally) -> None:
    waits = _waits(ag)
    val = ag.meta["val"]
    if waits is None or not val.is_floating_point():
        return
    inp = _staged_input(gm, ag)
    world, group = ag.args[1:3]
    role = ag.meta.get(ROLE, "gather")
    numel = inp.meta["val"].numel()
    before = wire_bytes("all_gather", tensor_bytes(val), world)
    segments = ag.meta.get(BUCKET_SEGMENTS)
    with gm.graph.inserting_before(ag):
        q = _quantize(gm, inp, 1, fmt, role, tally, segments)
        gathered = insert_call(gm, ALL_GATHER, (q, world, group), role=role)
    _mark(gathered, fmt, val.dtype, before, tally)
    for wait in waits:
        with gm.graph.inserting_before(wait):
            landed = insert_call(gm, WAIT, (gathered,), role=role)
            values = _dequantize(gm, landed, world, numel, fmt, val.dtype, role, tally, segments)
            full = insert_call(gm, aten.view.default, (values, list(val.shape)), role=role)
        wait.replace_all_uses_with(full)
        gm.graph.erase_node(wait)
    gm.graph.erase_node(ag)


def _all_to_all_reduce(
    gm: fx.GraphModule,
    chunks: fx.Node,
    world: int,
    group: str,
    op: str,
    fmt: QuantFormat,
    tally: _Tally,
    segments: list[int] | None = None,
) -> tuple[fx.Node, Callable[[], fx.Node]]:
    """Issue the quantized all-to-all of ``chunks`` (``world`` equal rows, each made of
    ``segments``) at the insertion point; returns it and ``finish()``, which inserts (at its own
    insertion point) the wait, the dequantize and the fp32 rank-ordered sum of this rank's
    chunk, ``[numel / world]``."""
    numel = chunks.meta["val"].numel() // world
    q = _quantize(gm, chunks, world, fmt, "reduce", tally, segments)
    row = q.meta["val"].numel() // world
    a2a = insert_call(gm, ALL_TO_ALL, (q, [row] * world, [row] * world, group), role="reduce")
    a2a.meta[COLLECTIVE] = "reduce_scatter"

    def finish() -> fx.Node:
        landed = insert_call(gm, WAIT, (a2a,), role="reduce")
        values = _dequantize(gm, landed, world, numel, fmt, torch.float32, "reduce", tally, segments)
        return rank_ordered_sum(gm, values, world, op)

    return a2a, finish


def _reduce_scatter(gm: fx.GraphModule, rs: fx.Node, fmt: QuantFormat, tally: _Tally) -> None:
    inp, op, world, group = rs.args[:4]
    waits = _waits(rs)
    val = inp.meta["val"]
    if waits is None or op not in ("sum", "avg") or world < 2 or val.shape[0] % world:
        return
    before = wire_bytes("reduce_scatter", tensor_bytes(val), world)
    with gm.graph.inserting_before(rs):
        a2a, finish = _all_to_all_reduce(gm, inp, world, group, op, fmt, tally, rs.meta.get(BUCKET_SEGMENTS))
    _mark(a2a, fmt, val.dtype, before, tally)
    out = rs.meta["val"]
    for wait in waits:
        with gm.graph.inserting_before(wait):
            total = finish()
        with gm.graph.inserting_before(total.next):  # in order, right after the sum
            result = _shaped(gm, total, out.dtype, list(out.shape))
        wait.replace_all_uses_with(result)
        gm.graph.erase_node(wait)
    gm.graph.erase_node(rs)


def _shaped(gm: fx.GraphModule, x: fx.Node, dtype: torch.dtype, shape: list[int]) -> fx.Node:
    if x.meta["val"].dtype != dtype:
        x = insert_call(gm, CONVERT, (x, dtype), role="reduce")
    return insert_call(gm, aten.view.default, (x, shape), role="reduce")


def _all_reduce(gm: fx.GraphModule, ar: fx.Node, fmt: QuantFormat, tally: _Tally) -> None:
    inp, op, group = ar.args[:3]
    waits = _waits(ar)
    val = inp.meta["val"]
    world = collective_group_size(COLLECTIVE_OPS[ALL_REDUCE], ar.args)
    if waits is None or op not in ("sum", "avg") or world < 2 or not val.is_floating_point():
        return
    numel = val.numel()
    chunk = math.ceil(numel / world)
    half = wire_bytes("reduce_scatter", tensor_bytes(val), world)  # each hop replaces half of the all-reduce
    with gm.graph.inserting_before(ar):
        flat = insert_call(gm, aten.reshape.default, (inp, [numel]), role="reduce")
        if chunk * world != numel:
            flat = insert_call(gm, aten.constant_pad_nd.default, (flat, [0, chunk * world - numel]), role="reduce")
        a2a, finish = _all_to_all_reduce(gm, flat, world, group, op, fmt, tally)
    _mark(a2a, fmt, val.dtype, half, tally)
    for wait in waits:
        with gm.graph.inserting_before(wait):
            mine = finish()
        with gm.graph.inserting_before(mine.next):  # in order, right after the sum
            q = _quantize(gm, mine, 1, fmt, "reduce", tally)
            gathered = insert_call(gm, ALL_GATHER, (q, world, group), role="reduce")
            landed = insert_call(gm, WAIT, (gathered,), role="reduce")
            values = _dequantize(gm, landed, world, chunk, fmt, val.dtype, "reduce", tally)
            values = insert_call(gm, aten.view.default, (values, [chunk * world]), role="reduce")
            if chunk * world != numel:
                values = insert_call(gm, aten.slice.Tensor, (values, 0, 0, numel), role="reduce")
            result = insert_call(gm, aten.view.default, (values, list(val.shape)), role="reduce")
        _mark(gathered, fmt, val.dtype, half, tally, hop=1)
        wait.replace_all_uses_with(result)
        gm.graph.erase_node(wait)
    gm.graph.erase_node(ar)


def quantize_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Cut the bytes of parameter gathers (qwZ) and gradient reductions (qgZ) by moving
    block-quantized integers; every reduction still sums in fp32."""
    comm = ctx.options.comm
    weights = quant_format(comm.quantize_weights, comm.quantize_block) if comm.quantize_weights else None
    grads = quant_format(comm.quantize_grads, comm.quantize_block) if comm.quantize_grads else None
    if weights is None and grads is None:
        return gm
    tallies = {"all-gathers": _Tally(), "gradient reductions": _Tally()}
    for node in list(gm.graph.nodes):
        # only zerofx's own gathers of parameters and reductions of gradients: hpZ's inner re-gather
        # stays exact (passes/secondary.py: the backward reads the forward's weights), and so does
        # every collective zerofx did not insert (a tensor-parallel plan's activations)
        role = node.meta.get(ROLE)
        if node.target in (ALL_GATHER, ALL_GATHER_OUT) and weights is not None and role == "gather":
            _gather(gm, node, weights, tallies["all-gathers"])
        elif node.target is REDUCE_SCATTER and grads is not None and role == "reduce":
            _reduce_scatter(gm, node, grads, tallies["gradient reductions"])
        elif node.target is ALL_REDUCE and grads is not None and role == "reduce":
            _all_reduce(gm, node, grads, tallies["gradient reductions"])
    device = ctx.cost.device_for(gm)
    for what, t in tallies.items():
        if not t.count:
            continue
        saved_s = ctx.cost.comm.seconds_per_byte * (t.before - t.after)
        compute_s = sum(device.node_time(n) for n in t.compute)
        ctx.report(
            f"quantized {t.count} {what}: {t.before} -> {t.after} B/rank on the wire; cost model: "
            f"{saved_s * 1e6:.1f} us of transfer saved, {compute_s * 1e6:.1f} us of quantize/dequantize added"
        )
    return gm


PASS = Pass(
    "quantize",
    quantize_pass,
    kinds=("forward", "backward", "inference"),
    reads=(BUCKET_SEGMENTS, ROLE),
    writes=(COLLECTIVE, QUANTIZED, ROLE),
)
