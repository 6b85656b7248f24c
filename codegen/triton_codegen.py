"""The "triton" executor's compile step: from the pipeline's final graph to one with fused kernels.

    final graph (ATen + collectives)
      -> decompose     composite ops opened into pointwise ops and last-dim reductions
      -> find_groups   fusible regions, never across a collective (codegen/fusion.py)
      -> emit_group    one readable Triton kernel per region (codegen/triton_emit.py)
      -> replace       each region becomes one call of a FusedKernel; the rest stays ATen

What it did is recorded like a pass: the dump gets ``NN_codegen.py`` (the graph with kernel
calls) and its diff, a summary line, and ``kernels/NN_<name>.py`` with every kernel's source.
Nothing here may break a graph: a group the emitter cannot write stays ATen (debug log), and if
this step itself fails the graph runs as ATen with a warning and a note in the dump.
"""

from __future__ import annotations

import logging
import operator
import time
from typing import Any

import torch
from torch import fx

from zerofx.codegen.decompose import decompose_for_codegen
from zerofx.codegen.fusion import Claimed, find_groups, group_io, is_comm, replace_groups
from zerofx.codegen.triton_emit import Unsupported, emit_group
from zerofx.codegen.triton_ops import _static, can_lower
from zerofx.codegen.triton_runtime import FusedKernel, group_module, interpreting, launch_problem
from zerofx.passes.contract import PassContext
from zerofx.passes.graph import copy_graph, is_view

log = logging.getLogger(__name__)


def graph_device(gm: fx.GraphModule) -> torch.device | None:
    """The device the graph's kernels would run on: the first non-CPU device any of its tensors
    is on, else the CPU (None: no tensors). Not simply the first tensor's: a GPU graph may take a
    CPU scalar first (a loss scale, a step count). Nodes that mix devices are ``can_lower``'s to
    refuse, one by one."""
    devices = {val.device for n in gm.graph.nodes if isinstance(val := n.meta.get("val"), torch.Tensor)}
    if not devices:
        return None
    accelerators = sorted((d for d in devices if d.type != "cpu"), key=str)
    return accelerators[0] if accelerators else torch.device("cpu")


def _log_unlowerable(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem or is_view(n) or is_comm(n):
            continue
        if not can_lower(n):
            log.debug("zerofx codegen: %s (%s) stays an ATen call: no Triton lowering for it here", n.name, n.target)


def _fuse(gm: fx.GraphModule, ctx: PassContext, recorder: Any, autotune: bool):
    work = copy_graph(gm)
    opened = decompose_for_codegen(work, can_lower)
    _log_unlowerable(work)
    claimed: list[Claimed] = []
    sources: list[tuple[str, str]] = []

    def on_failure(name: str, error: str) -> None:
        if recorder is not None:
            recorder.note(ctx.graph_id, ctx.kind, f"kernel {name} failed, its ops run as ATen: {error}")
            recorder.kernel_failed(ctx.graph_id, ctx.kind, name, error)

    for group in find_groups(work):
        inputs, outputs = group_io(group)
        try:
            source = emit_group(group.members, group.shape, group.classes, inputs, outputs, autotune=autotune)
        except Unsupported as e:
            log.debug("zerofx codegen: group at %s stays ATen: %s", group.members[0].name, e)
            continue
        kernel = FusedKernel(source, inputs, outputs, group_module(group.members, inputs, outputs), on_failure)
        claimed.append(Claimed(group, inputs, outputs, kernel))
        sources.append((source.name, source.source))
    result = replace_groups(work, claimed)
    # imported here: it imports triton, and without triton compile_triton returns before _fuse
    # (the graph runs as ATen with a warning) instead of failing on import
    from zerofx.codegen.quantize_kernels import use_quantize_kernels

    quantized = use_quantize_kernels(result)  # block quantization has its own kernels
    if quantized:
        ctx.report(f"{quantized} quantize/dequantize ops run as Triton kernels (codegen/quantize_kernels.py)")
    result.recompile()
    return result, claimed, sources, opened


_WARNED: set[tuple[str, str]] = set()  # (why, graph id): one warning per frame and process


def _symbolic(gm: fx.GraphModule) -> bool:
    """Whether a tensor placeholder of ``gm`` has a symbolic size or stride (nothing of it can
    lower). A symbolic scalar input (a Python int dynamo made dynamic) leaves the tensors static."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not _static(val):
            return True
    return False


def compile_triton(gm: fx.GraphModule, ctx: PassContext | None = None, recorder: Any = None) -> fx.GraphModule:
    """``gm`` with its fusible regions replaced by Triton kernels (``gm`` itself is not modified)."""
    ctx = ctx or PassContext("graph", "inference")
    ctx.messages = []
    start = time.perf_counter()
    autotune = ctx.options.codegen.autotune
    device = graph_device(gm)
    why = "the graph has no tensors" if device is None else launch_problem(device)
    if why is not None:
        log.warning("zerofx: executor='triton': %s; %s_%s runs as ATen", why, ctx.graph_id, ctx.kind)
        if recorder is not None:
            recorder.note(ctx.graph_id, ctx.kind, f"codegen: {why}; the graph runs as ATen")
        return gm

    if _symbolic(gm):
        why = (
            "its sizes are symbolic (dynamo compiled it for changing shapes: zerofx.compile's default dynamic='auto' "
            "does so after the first shape change), and the Triton kernels are emitted per static shape; pass "
            "dynamic=False to compile each shape with kernels (up to torch._dynamo.config.recompile_limit shapes "
            "per frame, 8 by default; later shapes run eagerly)"
        )
        if ("symbolic", ctx.graph_id) not in _WARNED:
            _WARNED.add(("symbolic", ctx.graph_id))
            log.warning("zerofx: executor='triton': %s_%s runs as ATen: %s", ctx.graph_id, ctx.kind, why)
        if recorder is not None:
            recorder.note(ctx.graph_id, ctx.kind, f"codegen: {why}; the graph runs as ATen")
        return gm

    try:
        result, claimed, sources, opened = _fuse(gm, ctx, recorder, autotune)
    except Exception as e:  # a codegen bug must not cost the user their training step
        log.warning(
            "zerofx: Triton codegen failed on %s_%s (%s: %s); the graph runs as ATen",
            ctx.graph_id,
            ctx.kind,
            type(e).__name__,
            e,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        if recorder is not None:
            recorder.note(ctx.graph_id, ctx.kind, f"codegen failed ({type(e).__name__}: {e}); the graph runs as ATen")
        return gm

    fused_ops = sum(c.group.compute_ops for c in claimed)
    if opened:
        ctx.report(f"decomposed {len(opened)} composite ops for fusion ({', '.join(opened)})")
    ctx.report(
        f"{len(claimed)} Triton kernels covering {fused_ops} ATen ops"
        + (" (run by the Triton interpreter)" if interpreting() else "")
    )
    for c in claimed:
        ctx.report(f"kernel {c.call.__name__}: {', '.join(m.name for m in c.group.members)}")
    if recorder is not None:
        recorder(ctx, "codegen", gm, result, time.perf_counter() - start)
        recorder.kernels(ctx.graph_id, ctx.kind, sources)
    return result
