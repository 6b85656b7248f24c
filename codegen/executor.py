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
required, and it returns a boxed callable. Counting and measuring what the callable does is not
the executor's business: ``zerofx.measure.instrument`` wraps whatever an executor returns.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from torch import fx
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx.graph import _BoxedCodeGen

from zerofx.passes.contract import PassContext
from zerofx.passes.graph import fake_mode_of

Executor = Callable[..., Callable]


def _aten_executor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    ctx: PassContext | None = None,
    recorder: Any = None,
) -> Callable:
    """Run the graph's FX-generated Python op by op, with the boxed calling convention.

    ``make_boxed_func`` would only wrap the graph, leaving AOTAutograd's argument list holding
    every input until the graph returns: a backward would then keep all saved activations
    alive to its end (docs/measurements.md, executor). FX's boxed codegen
    unpacks and clears the list, so each saved tensor dies at its last use in the backward,
    as in eager autograd.
    """
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def _triton_executor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    ctx: PassContext | None = None,
    recorder: Any = None,
) -> Callable:
    from zerofx.codegen.triton_codegen import compile_triton

    fused = compile_triton(gm, ctx, recorder)
    return make_boxed_func(fused)


def _placeholder_values(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _inductor_executor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    ctx: PassContext | None = None,
    recorder: Any = None,
) -> Callable:
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = list(example_inputs) if example_inputs is not None else _placeholder_values(gm)
    fake_mode = detect_fake_mode(inputs) or fake_mode_of(gm)
    start = time.perf_counter()
    with fake_mode:
        retraced = make_fx(gm, decomposition_table=select_decomp_table())(*inputs)
    if recorder is not None and ctx is not None:
        ctx.messages = []  # this step's own, as the pipeline starts each pass's
        ctx.report("re-traced with Inductor's decompositions; Inductor compiles this graph")
        recorder(ctx, "inductor", gm, retraced, time.perf_counter() - start)
    compiled = compile_fx_inner(retraced, inputs)
    return compiled


_EXECUTORS: dict[str, Executor] = {"aten": _aten_executor, "triton": _triton_executor, "inductor": _inductor_executor}
EXECUTOR_NAMES = tuple(_EXECUTORS)


def make_executor(name: str) -> Executor:
    """The executor called ``name`` (validated earlier by ``zerofx.options.Options``)."""
    return _EXECUTORS[name]
