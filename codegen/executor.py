"""Executors: callables that run a final graph with AOTAutograd's boxed calling convention.

Every executor reports the graph's collectives to ``zerofx.metrics`` each time the graph runs
(their sizes are static: they come from the graph's fake-tensor metadata), which is what
``CollectiveCounter`` counts, and runs the graph under ``zerofx.memory.MemoryTracker``'s
dispatch mode when one is active (torch.compile would not run compiled code under a mode
entered outside it).

The generated code takes its inputs as one list and clears it (FX's boxed codegen, as torch's
own ``boxed_nop`` does), so each input is released after its last use in the graph rather than
when the graph returns: a backward graph frees each saved activation as soon as it has used it.
"""

from __future__ import annotations

from typing import Callable

from torch import fx
from torch.fx.graph import _BoxedCodeGen

from zerofx.memory import active_tracker
from zerofx.metrics import COLLECTIVE_OPS, collective_group_size, record_collectives, wire_bytes


def graph_collectives(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """``(kind, wire bytes per rank)`` of every collective ``gm`` issues, in graph order."""
    out = []
    for node in gm.graph.nodes:
        spec = COLLECTIVE_OPS.get(node.target)
        if spec is None:
            continue
        val = (node if spec.sized == "out" else node.args[0]).meta["val"]
        out.append((spec.kind, wire_bytes(spec.kind, val.numel() * val.element_size(),
                                          collective_group_size(spec, node.args))))
    return out


def _instrumented(fn: Callable, gm: fx.GraphModule, stage: str, num_user_outputs: int | None) -> Callable:
    """``fn`` plus collective counting and, when a MemoryTracker is active, memory tracking."""
    collectives = graph_collectives(gm)

    def run(args: list) -> object:
        if collectives:
            record_collectives(collectives)
        tracker = active_tracker()
        if tracker is not None:
            return tracker.run_graph(fn, args, stage, num_user_outputs)
        return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _aten_executor(gm: fx.GraphModule, stage: str = "forward", num_user_outputs: int | None = None) -> Callable:
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return _instrumented(gm.forward, gm, stage, num_user_outputs)


_EXECUTORS = {"aten": _aten_executor}


def make_executor(name: str) -> Callable[..., Callable]:
    """The executor called ``name`` (validated earlier by ``zerofx.options.Options``)."""
    return _EXECUTORS[name]
