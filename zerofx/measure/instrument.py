"""What a compiled graph does when it runs, counted: its collectives (for ``CollectiveCounter``)
and, under a ``MemoryTracker``, its buffers. Wraps an executor's callable; executors know
nothing of it.

A graph's collectives are static: their sizes come from its fake-tensor metadata, so they are
read once, at wrap time, and reported each time the graph runs.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import fx

from zerofx import stress
from zerofx.ir.collectives import COLLECTIVE_OPS, collective_group_size, collective_kind, record_collectives, wire_bytes
from zerofx.ir.meta import QUANTIZED
from zerofx.measure.graph_buffers import active_tracker

__all__ = ["graph_collectives", "instrument"]


def graph_collectives(gm: fx.GraphModule) -> list[tuple[str, int, str, str, int]]:
    """``(kind, wire bytes per rank, group name, wire, unquantized bytes)`` of every collective
    ``gm`` issues, in graph order (``record_collectives``' tuples)."""
    out = []
    for node in gm.graph.nodes:
        spec = COLLECTIVE_OPS.get(node.target)
        if spec is None:
            continue
        val = (node if spec.sized == "out" else node.args[0]).meta["val"]
        kind = collective_kind(node)
        nbytes = wire_bytes(kind, val.numel() * val.element_size(), collective_group_size(spec, node.args))
        wire, before = str(val.dtype).replace("torch.", ""), nbytes
        if QUANTIZED in node.meta:  # passes/quantize.py: (format, dtype it replaced, bytes it replaced)
            wire_format, _, before = node.meta[QUANTIZED]
            wire = wire_format.split()[0]
        out.append((kind, nbytes, node.args[spec.group_name_arg], wire, before))
    return out


def instrument(fn: Callable, gm: fx.GraphModule, ctx: Any = None) -> Callable:
    """``fn`` (an executor's boxed callable for ``gm``) plus collective counting, stress delays
    (zerofx/stress.py) and, when a ``MemoryTracker`` is active, memory tracking (torch.compile
    would not run compiled code under a mode entered outside it)."""
    collectives = graph_collectives(gm)
    fn = stress.wrap_graph(fn)  # seeded sleeps at collectives when ZEROFX_STRESS_DELAY is set (zerofx/stress.py)
    kind = ctx.kind if ctx is not None else "forward"
    num_user_outputs = ctx.num_fwd_outputs if ctx is not None and kind == "forward" else None

    def run(args: list) -> object:
        if collectives:
            record_collectives(collectives)
        tracker = active_tracker()
        if tracker is not None:
            return tracker.run_graph(fn, args, kind, num_user_outputs)
        return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
