"""Executors: turn a final graph into a callable with AOTAutograd's boxed calling convention.

    "aten"      the graph op by op (FX's generated Python, boxed: each value, inputs included,
                is freed after its last use). The default, and the reference the others are
                checked against.
    "triton"    fusible regions become generated Triton kernels, the rest stays ATen
                (codegen/triton_codegen.py). Needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU;
                where neither is there, the graph runs as ATen with a warning.
    "inductor"  hands the final graph to Inductor, for comparison. Inductor expects graphs
                traced with its own decomposition table, so the graph is re-traced with it
                first (make_fx, in the same order, collectives included); Inductor then owns
                the schedule of the whole graph, including where it puts collective waits.

An executor is called as ``execute(gm, example_inputs, ctx, recorder)``; only ``gm`` is
required. Every executor reports the graph's collectives to ``zerofx.metrics`` each time the
graph runs (their sizes are static: they come from the graph's fake-tensor metadata), which is
what ``CollectiveCounter`` counts.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from torch import fx
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx.graph import _BoxedCodeGen

from zerofx import stress
from zerofx.memory import active_tracker
from zerofx.metrics import COLLECTIVE_OPS, collective_group_size, collective_kind, record_collectives, wire_bytes
from zerofx.passes.pipeline import PassContext

Executor = Callable[..., Callable]


def graph_collectives(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """``(kind, wire bytes per rank)`` of every collective ``gm`` issues, in graph order."""
    out = []
    for node in gm.graph.nodes:
        spec = COLLECTIVE_OPS.get(node.target)
        if spec is None:
            continue
        val = (node if spec.sized == "out" else node.args[0]).meta["val"]
        kind = collective_kind(node)
        out.append((kind, wire_bytes(kind, val.numel() * val.element_size(),
                                          collective_group_size(spec, node.args))))
    return out


def _counting(fn: Callable, gm: fx.GraphModule, ctx: PassContext | None = None) -> Callable:
    """``fn`` plus collective counting and, when a ``zerofx.memory.MemoryTracker`` is active,
    memory tracking (torch.compile would not run compiled code under a mode entered outside)."""
    collectives = graph_collectives(gm)
    fn = stress.wrap_graph(fn)  # seeded sleeps at collectives when ZEROFX_STRESS_DELAY is set (zerofx/stress.py)
    stage = ctx.stage if ctx is not None else "forward"
    num_user_outputs = getattr(ctx, "num_fwd_outputs", None) if stage == "forward" else None

    def run(args: list) -> object:
        if collectives:
            record_collectives(collectives)
        tracker = active_tracker()
        if tracker is not None:
            return tracker.run_graph(fn, args, stage, num_user_outputs)
        return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _aten_executor(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None,
                   ctx: PassContext | None = None, recorder: Any = None) -> Callable:
    """Run the graph's FX-generated Python op by op, with the boxed calling convention.

    ``make_boxed_func`` would only wrap the graph, leaving AOTAutograd's argument list holding
    every input until the graph returns: a backward would then keep all saved activations
    alive to its end (measured: ~25% higher step peak on the test GPT). FX's boxed codegen
    unpacks and clears the list, so each saved tensor dies at its last use in the backward,
    as in eager autograd.
    """
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return _counting(gm, gm, ctx)


def _triton_executor(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None,
                     ctx: PassContext | None = None, recorder: Any = None) -> Callable:
    from zerofx.codegen.triton_codegen import compile_triton

    fused = compile_triton(gm, ctx, recorder)
    return _counting(make_boxed_func(fused), gm, ctx)


def _placeholder_values(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _inductor_executor(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None,
                       ctx: PassContext | None = None, recorder: Any = None) -> Callable:
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from zerofx.passes.fx_nodes import fake_mode_of

    inputs = list(example_inputs) if example_inputs is not None else _placeholder_values(gm)
    fake_mode = detect_fake_mode(inputs) or fake_mode_of(gm)
    start = time.perf_counter()
    with fake_mode:
        retraced = make_fx(gm, decomposition_table=select_decomp_table())(*inputs)
    if recorder is not None and ctx is not None:
        ctx.messages = ["re-traced with Inductor's decompositions; Inductor compiles this graph"]
        recorder(ctx, "inductor", gm, retraced, time.perf_counter() - start)
    compiled = compile_fx_inner(retraced, inputs)
    return _counting(compiled, gm, ctx)


_EXECUTORS: dict[str, Executor] = {"aten": _aten_executor, "triton": _triton_executor, "inductor": _inductor_executor}
EXECUTOR_NAMES = tuple(_EXECUTORS)


def make_executor(name: str) -> Executor:
    """The executor called ``name`` (validated earlier by ``zerofx.options.Options``)."""
    return _EXECUTORS[name]
