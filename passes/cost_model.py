"""One home for memory/compute/communication estimates.

Every decision that trades memory for time (what to save, recompute or offload, what to
prefetch or bucket) reads its numbers from here, so decisions can be explained before anything
runs and checked against what was measured afterwards. The estimates come from the graphs'
fake-tensor metadata (``node.meta["val"]``) only; nothing is executed.

The API is small on purpose:

    node_bytes(node)                      bytes of the value a node produces
    node_flops(node)                      floating-point operations to compute it
    op_flops(func, args, kwargs, out)     the same for one call of an op on real tensors
    storage_key(node)                     which buffer the value lives in (views share one)
    storage_bytes(node)                   bytes of that whole buffer
    estimate_memory(gm, ...)              liveness-based peak of the bytes a graph allocates
    op_workspace_bytes(node)              bytes an op holds only while it runs (quantize / dequantize)
    PeakProbe(gm, facts)                  the same peak for reorders of one stretch, simulating only it
    memory_timeline(gm, ...)              the same simulation node by node (symbolic on request)
    estimate_time(gm, device, comm_for)   compute and exposed communication of a graph, simulated
    saved_activation_bytes(fw_gm, n)      bytes a forward graph keeps alive for the backward
    tensor_bytes(val) / node_bytes(node)  the one byte count (symbolic on request)
    is_alias(node)                        the one aliasing rule (views, waits, in-place, ...)
    predict_step_peak(estimates, ids)     a step's peak from its graphs' estimates
    DeviceModel                           the one device-rate model: FLOPs and bytes -> seconds
    CostModel(comm, device)               device rates + collective constants, what passes price with
    calibrate_comm(group)                 measure the collective constants on the mesh, cached

# NOTE: symbolic sizes
With dynamic shapes, sizes are SymInts. ``node_bytes``/``node_flops`` accept ``symbolic=True``
and then return a sympy expression in the graph's size symbols (``s0``, ``s1``...), which is what
a report or a later symbolic peak analysis wants. Decisions need numbers: by default both
return plain ints, evaluated at the size hints of the example inputs that were traced (the same
convention as torch's partitioner), with a fallback for unbacked sizes.

# NOTE: FLOP counting
Matmul-like ops (mm, addmm, bmm, convolutions, attention) use the formulas torch registers for
``torch.utils.flop_counter`` (its attention formulas for CPU flash attention too, which it leaves
out) (2 FLOPs per multiply-add), applied to metadata shapes. Every other
op that computes values counts one FLOP per output element (pointwise ops), or one per input
element when the output is smaller (reductions such as sum or layer-norm statistics). Block quantize / dequantize
(zerofx/ir/quantize.py) count ``QUANTIZE_FLOPS`` per value. Views,
``getitem``, collectives and zerofx's marker ops cost nothing here: they move or alias data,
which the communication model prices, not this one.

# NOTE: one memory estimator
``estimate_memory`` simulates a graph's liveness (alias annotations of op schemas decide what
shares storage, collective buffers are allocated at issue, owned inputs are freed at last use);
scheduling, bucketing reports, ``predict_step_peak`` and the dump's per-graph notes all read it,
and it is tested against the allocator. The activation planner prices single values, not a
timeline: ``storage_key`` / ``storage_bytes`` (fake storages) say which buffer a saved value
keeps alive.

Communication is ``latency + wire_bytes * seconds_per_byte`` per collective (wire bytes per
rank, see zerofx.ir.collectives NOTE: counting collective bytes), with constants measured on the
actual process group by ``calibrate_comm`` and cached per (backend, world size). Compute is a
roofline over the ``DeviceModel`` of the graph's device, the same rates for every decision.
"""

from __future__ import annotations

import json
import operator
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import sympy
import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from zerofx.ir.collectives import (
    COLLECTIVE_OPS,
    PAIR_GATHER_OUT,
    WAIT,
    all_gather,
    backend_of,
    collective_group_size,
    collective_kind,
    wire_bytes,
)
from zerofx.ir.meta import BORROWED_INPUTS
from zerofx.ir.offload_ops import OFFLOAD
from zerofx.ir.quantize import (
    DEQUANTIZE,
    QUANTIZE,
    QuantFormat,
    dequantize_workspace_bytes,
    quantize_workspace_bytes,
)
from zerofx.passes.graph import is_view

__all__ = [
    "hint",
    "tensor_bytes",
    "node_bytes",
    "op_flops",
    "node_flops",
    "is_alias",
    "storage_key",
    "storage_root",
    "storage_bytes",
    "allocated_bytes",
    "saved_values",
    "saved_activation_bytes",
    "MemoryEstimate",
    "op_workspace_bytes",
    "estimate_memory",
    "PeakProbe",
    "memory_timeline",
    "predict_step_peak",
    "DeviceModel",
    "TimeEstimate",
    "estimate_time",
    "CommModel",
    "CostModel",
    "calibrate_comm",
    "ALIAS_OPS",
]

# FLOPs per value of block quantization (zerofx/ir/quantize.py): quantize takes |x|, the block
# max, a multiply, an add and a floor (plus a clamp, folded in); dequantize one multiply and
# the cast. What the quantize pass's report prices against the bytes it saves.
QUANTIZE_FLOPS = {QUANTIZE: 5, DEQUANTIZE: 2}
# CPU flash attention (what SDPA runs on CPU), forward (q, k, v, ...) and backward (grad, q, k, v,
# ...): counted with torch's formulas for the GPU kernels (torch registers none for these), not as
# pointwise ops
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda a: sdpa_flop_count(
        a[0].shape, a[1].shape, a[2].shape
    ),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda a: sdpa_backward_flop_count(
        a[0].shape, a[1].shape, a[2].shape, a[3].shape
    ),
}
# size assumed for a data-dependent dimension with no hint (as torch does)
UNBACKED_FALLBACK = 4096
# ops whose output shares its input's buffer although their schema does not say so
ALIAS_OPS = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default})


def hint(x: Any) -> int:
    """A concrete int for ``x`` (an int, a SymInt or a sympy expression), from the trace's hints."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        if node.hint is not None:
            return int(node.hint)
        try:
            return int(node.shape_env.size_hint(node.expr, allow_none=False))
        except Exception:  # unbacked (data-dependent): no hint exists
            return UNBACKED_FALLBACK
    if isinstance(x, sympy.Expr):
        if x.is_number:
            return int(x)
        return int(x.subs({s: UNBACKED_FALLBACK for s in x.free_symbols}))
    return int(x)


def _expr(x: Any) -> sympy.Expr:
    """``x`` as a sympy expression in the graph's size symbols."""
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def _tensor_vals(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _numel(val: torch.Tensor, symbolic: bool) -> Any:
    n = val.numel()
    return _expr(n) if symbolic else hint(n)


def tensor_bytes(val: Any, symbolic: bool = False) -> Any:
    """Bytes of a (fake) tensor, or of every tensor in a tuple/list of them (0 for anything else).

    The one byte count of zerofx (see NOTE: symbolic sizes): an int at the trace's size hints,
    or with ``symbolic=True`` a sympy expression in the graph's size symbols."""
    total: Any = sympy.Integer(0) if symbolic else 0
    for v in _tensor_vals(val):
        total = total + _numel(v, symbolic) * v.element_size()
    return total


def node_bytes(node: fx.Node, *, symbolic: bool = False) -> Any:
    """Bytes of the tensor(s) ``node`` produces: ``tensor_bytes`` of its ``meta["val"]``."""
    return tensor_bytes(node.meta.get("val"), symbolic)


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any, *, symbolic: bool = False) -> Any:
    """FLOPs of one call ``func(*args, **kwargs) -> out`` (see NOTE: FLOP counting).

    Works on real and fake tensors alike, so the cost model (on metadata) and the memory tracker
    (on the running program) count the same way and their numbers can be compared exactly."""
    zero: Any = sympy.Integer(0) if symbolic else 0
    if not isinstance(func, torch._ops.OpOverload) or func.is_view or func in ALIAS_OPS:
        return zero
    if func in QUANTIZE_FLOPS:  # per value: quantize reads it, dequantize writes it
        vals = args[0] if func is QUANTIZE else out
        return QUANTIZE_FLOPS[func] * _numel(vals, symbolic)
    if func.namespace in ("_c10d_functional", "c10d_functional", "zerofx", "ao"):
        return zero
    if any(r.alias_info is not None for r in func._schema.returns):
        return zero  # in-place and out= variants alias their input: counted as copies, not compute
    if func.overloadpacket in CPU_ATTENTION:  # torch registers no formula for the CPU kernels
        flops = CPU_ATTENTION[func.overloadpacket](args)
        return _expr(flops) if symbolic else hint(flops)
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        try:
            flops = formula(*args, **kwargs, out_val=out)
        except Exception:  # a formula that cannot read these args: fall back to elementwise
            flops = None
        if flops is not None:
            return _expr(flops) if symbolic else hint(flops)
    out_n = sum((_numel(v, symbolic) for v in _tensor_vals(out)), zero)
    in_vals = [a for a in args if isinstance(a, torch.Tensor)]
    in_vals += [x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
    in_n = sum((_numel(a, symbolic) for a in in_vals), zero)
    if symbolic:
        return sympy.Max(out_n, in_n) if in_n != 0 else out_n
    return max(out_n, in_n)


def node_flops(node: fx.Node, *, symbolic: bool = False) -> Any:
    """Floating-point operations to compute ``node`` (see NOTE: FLOP counting)."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return sympy.Integer(0) if symbolic else 0
    args, kwargs = fx.node.map_aggregate(
        (node.args, node.kwargs), lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a
    )
    return op_flops(node.target, args, kwargs, node.meta.get("val"), symbolic=symbolic)


def storage_key(node: fx.Node) -> Any:
    """Identity of the buffer ``node``'s tensor lives in: views and aliases of one buffer share it.

    Fake tensors keep real aliasing (a view's fake storage is its base's), which is what makes
    this exact for views, ``_unsafe_view`` and ops whose output aliases an input."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return StorageWeakRef(val.untyped_storage()).cdata
        except Exception:  # tensors without storage (e.g. some subclasses): treat as their own
            pass
    return ("node", node)


def storage_bytes(node: fx.Node) -> int:
    """Bytes of the whole buffer ``node``'s value lives in (a view of a big buffer keeps all of it)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return hint(val.untyped_storage().nbytes())
        except Exception:
            pass
    return node_bytes(node)


def saved_values(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The forward graph's outputs that exist only to be saved for the backward."""
    (outputs,) = [n.args[0] for n in fw_gm.graph.nodes if n.op == "output"]
    return [o for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node)]


def borrowed_inputs(fw_gm: fx.GraphModule, saved: list[fx.Node], num_fwd_outputs: int = 0) -> frozenset[str]:
    """Names of the ``saved`` values that are ``fw_gm``'s own inputs or views of them (parameter
    shards, user data), or that share a buffer with one of its first ``num_fwd_outputs`` outputs
    (what the caller gets: a model's returned logits, which the backward may also read): the
    backward's inputs of those names free nothing when it drops them, their owner holds them
    (``BORROWED_INPUTS``; the partition keeps forward node names for backward inputs).

    The caller is taken to hold what a forward returned until that frame's backward returns
    (``predict_step_peak`` counts a forward's outputs until then), as a loop that keeps the
    model's output object through ``loss.backward()`` does; freeing a saved output at its last
    use in the backward as well would count it gone while the caller holds it (an HF causal LM at
    bf16 rebuilds its fp32 log-probabilities from the bf16 logits it returned). A caller that
    drops the output first (the HF Trainer) is planned high by that buffer, never low."""
    held = {storage_key(n) for n in fw_gm.graph.nodes if n.op == "placeholder"}
    if num_fwd_outputs:
        (outputs,) = [n.args[0] for n in fw_gm.graph.nodes if n.op == "output"]
        held |= {storage_key(o) for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)}
    return frozenset(n.name for n in saved if storage_key(n) in held)


def saved_activation_bytes(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes of the buffers a forward graph keeps alive for its backward ("activation memory").

    Counted per buffer, so two saved views of one tensor cost it once; buffers of the graph's
    inputs (parameter shards, user inputs) cost nothing: their owner keeps them alive anyway."""
    input_keys = {storage_key(n) for n in fw_gm.graph.nodes if n.op == "placeholder"}
    total, seen = 0, set(input_keys)
    for node in saved_values(fw_gm, num_fwd_outputs):
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        key = storage_key(node)
        if key in seen:
            continue
        seen.add(key)
        total += storage_bytes(node)
    return total


# ---------------------------------------------------------------------------------- memory --


def is_alias(node: fx.Node) -> bool:
    """The one aliasing rule: ``node``'s output lives in a buffer one of its inputs already has,
    so it allocates nothing, saving it costs its base's buffer and recomputing it is free.

    True for views, ``ALIAS_OPS`` (``_unsafe_view``, ``alias``), the elements of a multi-output
    alias (``split``'s getitems), waits (a wait returns its collective's buffer), and in-place
    or ``out=`` ops (their schema's return carries an alias annotation)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, fx.Node) and is_alias(parent)
    if target is WAIT or target in ALIAS_OPS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return target.is_view or (len(returns) == 1 and returns[0].alias_info is not None)


def allocated_bytes(node: fx.Node, symbolic: bool = False):
    """Bytes newly allocated by ``node`` on the device (0 for views, waits and in-place ops, and
    for an activation parked off the device: on disk, or in host memory from an accelerator;
    only the host tier on a CPU device parks in the device's own memory)."""
    if is_alias(node) or node.op != "call_function" or _parked_off_device(node):
        return sympy.Integer(0) if symbolic else 0
    return tensor_bytes(node.meta.get("val"), symbolic)


def _parked_off_device(node: fx.Node) -> bool:
    if node.target is not OFFLOAD:
        return False
    x = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return node.args[1] == "disk" or (isinstance(x, torch.Tensor) and x.device.type != "cpu")


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage an aliasing node returns (``out=`` for out variants)."""
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None


def storage_root(node: fx.Node) -> fx.Node:
    """The node that allocated the buffer ``node``'s value lives in, through the aliases
    ``is_alias`` names (views, waits, in-place and ``out=`` ops)."""
    while is_alias(node) and _aliased_input(node) is not None:
        node = _aliased_input(node)
    return node


@dataclass(frozen=True)
class MemoryEstimate:
    """Liveness simulation of one graph, in graph order."""

    peak_bytes: int  # most bytes allocated by the graph at once (inputs excluded unless freed)
    peak_node: str  # the node at which that happened
    output_bytes: int  # bytes still alive at the end that the graph allocated (its outputs)
    tangent_bytes: int = 0  # a backward's incoming gradients (inputs the autograd engine allocates)


# NOTE: collective workspace
# Backends may hold buffers of their own while a collective runs. gloo's all-gather gathers into
# a flat buffer it allocates and copies the result out of it (ProcessGroupGloo's allgather), so
# for the duration of the collective a rank holds one more output-sized buffer; NCCL writes into
# the output. gloo runs the collective on its own thread, so the buffer exists from the issue
# until the wait returns (measured with AllocationTrace: it appears after compute the graph ran
# past the issue, benchmarks/plan_accuracy.py); the simulation holds it over that window. Over two
# gloo ranks the exchange pass replaces the all-gather with an all-to-all into the output, which
# has no such buffer.


def collective_workspace_bytes(node: fx.Node, symbolic: bool = False) -> Any:
    """Bytes the backend itself allocates while ``node`` (a collective) runs (NOTE: collective workspace)."""
    zero: Any = sympy.Integer(0) if symbolic else 0
    spec = COLLECTIVE_OPS.get(node.target) if node.op == "call_function" else None
    if spec is None or spec.kind != "all_gather" or node.target is PAIR_GATHER_OUT:
        return zero  # the pair exchange receives into the output (zerofx/ir/collectives.py, NOTE: pair exchange)
    try:
        backend = backend_of(node.args[spec.group_name_arg])
    except (ValueError, RuntimeError, KeyError):  # a group name no process group is registered under
        return zero
    return tensor_bytes(node.meta.get("val"), symbolic) if backend == "gloo" else zero


# NOTE: op workspace
# Some ops allocate buffers of their own that die before they return: the bytes are live only
# while the op runs, on top of everything live at that node (unlike a collective's workspace,
# held until its wait). Counted for block quantize / dequantize (ZeRO++'s qwZ / qgZ), whose ATen
# bodies work in one fp32 buffer of the whole padded bucket: 4 bytes per value, 4x an int8
# payload; without it a plan with qwZ / qgZ was 20-48% under a measured step's peak. The
# formulas are zerofx/ir/quantize.py's (NOTE: quantize workspace), derived from the ops those
# bodies run and checked against the allocator op by op (tests/test_quantize.py) and step by
# step (tests/test_plan.py). They price the ATen bodies, the default executor's and the
# CPU's: the cost model has no notion of the executor. The "triton" executor's kernels
# (codegen/quantize_kernels.py) allocate only their outputs for a plain row, so there this is an
# upper bound; a bucket's row of pieces (zerofx/ir/quantize.py, NOTE: segments) they run on a
# block-padded copy, holding also its packed bytes (about one byte per value): up to about a
# quarter above this estimate for fp32 rows (a reviewer's probe, interpreter, 2026-12-07).
# Symbolic sizes give a polynomial upper bound (quantize.py says how).


def op_workspace_bytes(node: fx.Node, symbolic: bool = False) -> Any:
    """Bytes ``node`` holds above its output only while it runs (NOTE: op workspace)."""
    zero: Any = sympy.Integer(0) if symbolic else 0
    if node.op != "call_function" or node.target not in (QUANTIZE, DEQUANTIZE):
        return zero
    schema = node.target._schema
    args = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    args.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    args.update(node.kwargs)
    fmt = QuantFormat(args["bits"], args["block"], bool(args.get("floating", False)))
    value = args["x"] if node.target is QUANTIZE else args["packed"]
    val, out = (value.meta.get("val") if isinstance(value, fx.Node) else None), node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return zero

    def size(n: Any) -> Any:  # exact at concrete sizes (ints), sympy where a size is symbolic
        if symbolic and isinstance(n, torch.SymInt) and _expr(n).free_symbols:
            return _expr(n)
        return hint(n)

    # sizes from the values (an argument may be a node computing a size): the quantized rows
    # are the output's, the dequantized values per row the output's columns
    segments = args.get("segments")  # a bucket's pieces of a row (zerofx/ir/quantize.py, NOTE: segments)
    if node.target is QUANTIZE:
        out = quantize_workspace_bytes(size(val.numel()), hint(out.shape[0]), fmt, segments)
    else:
        out = dequantize_workspace_bytes(hint(val.shape[0]), size(out.shape[1]), fmt, args["dtype"], segments)
    return sympy.sympify(out) if symbolic else int(out)


@dataclass(frozen=True)
class NodeFacts:
    """What the liveness simulation reads of each node that does not depend on where the node
    stands: its storage root, the bytes it allocates, its backend workspace, a placeholder's
    bytes. Valid while the graph's nodes, their arguments and their ``meta["val"]`` stay as they
    were, however they are reordered: the schedule pass builds them once and simulates every
    move it tries with them, instead of walking every alias chain again for each try. The
    simulation rebuilds them when the number of nodes changed; a node rewired or replaced at the
    same count is the caller's to avoid (the schedule pass only moves nodes)."""

    symbolic: bool
    root: dict[fx.Node, fx.Node]
    allocated: dict[fx.Node, Any]
    workspace: dict[fx.Node, Any]
    transient: dict[fx.Node, Any]
    input_bytes: dict[fx.Node, Any]
    input_roots: dict[fx.Node, tuple[fx.Node, ...]]  # the storage roots a node reads, each once

    @classmethod
    def of(cls, gm: fx.GraphModule, symbolic: bool = False) -> NodeFacts:
        nodes = list(gm.graph.nodes)
        root = {n: storage_root(n) for n in nodes}
        return cls(
            symbolic,
            root,
            {n: allocated_bytes(n, symbolic) for n in nodes},
            {n: collective_workspace_bytes(n, symbolic) for n in nodes},
            {n: op_workspace_bytes(n, symbolic) for n in nodes},
            {n: tensor_bytes(n.meta.get("val"), symbolic) for n in nodes if n.op == "placeholder"},
            {n: tuple(dict.fromkeys(root[i] for i in n.all_input_nodes)) for n in nodes},
        )


def returned_bytes(fw_gm: fx.GraphModule, num_fwd_outputs: int, symbolic: bool = False) -> Any:
    """Bytes of the buffers a forward graph allocated for what it returns to its caller (its first
    ``num_fwd_outputs`` outputs, not what it saves for the backward), each buffer once: a model's
    logits and cache, which a caller holding the output object still holds when the backward
    has freed everything else the forward made (stage 1's boundary reduce runs then)."""
    facts = NodeFacts.of(fw_gm, symbolic)
    (outputs,) = [n.args[0] for n in fw_gm.graph.nodes if n.op == "output"]
    roots = dict.fromkeys(facts.root[o] for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node))
    zero: Any = sympy.Integer(0) if symbolic else 0
    return sum((facts.allocated[r] for r in roots if r.op == "call_function"), zero)


def _last_uses(nodes: list[fx.Node], input_roots: dict[fx.Node, tuple[fx.Node, ...]]) -> dict[fx.Node, int]:
    """Each storage root's position of last use among ``nodes`` (graph order: the last write wins)."""
    last_use: dict[fx.Node, int] = {}
    for idx, node in enumerate(nodes):
        for root in input_roots[node]:
            last_use[root] = idx
    return last_use


def _simulate(
    nodes: list[fx.Node],
    facts: NodeFacts,
    frees: dict[int, list[fx.Node]],
    live: Any,
    pending: dict[fx.Node, Any],
) -> Iterator[tuple[Any, Any]]:
    """The liveness step every simulation here shares, node by node: yields ``(live bytes
    entering the node, live bytes right after it allocated)`` (an op's own workspace included:
    NOTE: op workspace), then releases a collective's backend workspace at its wait and frees
    the roots ``frees`` lists at that position (by index into ``nodes``). ``pending`` (collective -> workspace not yet released) is updated in
    place, so a caller can read it between steps."""
    allocated, workspace_of, input_bytes = facts.allocated, facts.workspace, facts.input_bytes
    transient_of = facts.transient
    for idx, node in enumerate(nodes):
        before = live
        workspace = workspace_of[node]
        if workspace != 0:  # held by the backend until the collective is waited on
            pending[node] = workspace
        live = live + allocated[node] + workspace
        transient = transient_of[node]
        if transient != 0:  # held only while the op runs (NOTE: op workspace)
            yield before, live + transient
        else:
            yield before, live
        if pending and node.target is WAIT and node.op == "call_function" and node.args[0] in pending:
            live = live - pending.pop(node.args[0])
        for dead in frees.get(idx, ()):
            live = live - (input_bytes[dead] if dead.op == "placeholder" else allocated[dead])


def _liveness(
    gm: fx.GraphModule,
    inputs_freed_at_last_use: bool,
    owned_inputs: Iterable[str] | None,
    symbolic: bool,
    facts: NodeFacts | None = None,
) -> tuple[list[tuple[str, Any]], Any]:
    """The one liveness simulation behind ``estimate_memory`` and ``memory_timeline``: for every
    node in graph order, the bytes live right after it allocated (before what dies there is
    freed), relative to the live bytes before the graph; and the bytes of the graph's outputs."""
    if facts is None or facts.symbolic != symbolic or len(facts.root) != len(gm.graph.nodes):
        facts = NodeFacts.of(gm, symbolic)
    nodes = list(gm.graph.nodes)
    outputs = set(facts.input_roots[nodes[-1]])
    last_use = _last_uses(nodes, facts.input_roots)
    names = set(owned_inputs or ())
    borrowed = gm.meta.get(BORROWED_INPUTS, ()) if inputs_freed_at_last_use else ()
    owned = {
        n
        for n in nodes
        if n.op == "placeholder" and ((inputs_freed_at_last_use and n.name not in borrowed) or n.name in names)
    }
    frees: dict[int, list[fx.Node]] = {}
    for root, idx in last_use.items():
        if root not in outputs and (root.op != "placeholder" or root in owned):
            frees.setdefault(idx, []).append(root)
    start: Any = sympy.Integer(0) if symbolic else 0  # relative to the start: owned inputs are already live
    steps = _simulate(nodes, facts, frees, start, {})
    timeline = [(node.name, after) for node, (_, after) in zip(nodes, steps)]
    out_bytes = sum((facts.allocated[r] for r in outputs if r.op == "call_function"), start)
    return timeline, out_bytes


def estimate_memory(
    gm: fx.GraphModule,
    inputs_freed_at_last_use: bool = False,
    owned_inputs: Iterable[str] | None = None,
    facts: NodeFacts | None = None,
) -> MemoryEstimate:
    """Simulate allocation and freeing of ``gm``'s values in graph order.

    Values die after their last use (FX's generated code drops them then), except graph
    outputs. Aliases (views, waits, in-place ops) keep their storage root alive. A
    collective's output is allocated when it is issued. Inputs are not counted and, by
    default, not freed (a forward's inputs are parameters and user data held elsewhere). Inputs
    the graph owns are freed at their last use: with ``inputs_freed_at_last_use`` (a backward
    run with the boxed calling convention, which drops each saved tensor at its last use) all
    but those the graph module's ``BORROWED_INPUTS`` names (saved parameter shards and user
    data: dropping them frees nothing), or those named in ``owned_inputs``. The result is
    relative to the live bytes before the graph (owned inputs included), so the peak is what
    running the graph adds. ``facts``: ``NodeFacts.of(gm)`` built earlier, for a caller that
    simulates many orders of the same nodes.
    """
    timeline, out_bytes = _liveness(gm, inputs_freed_at_last_use, owned_inputs, symbolic=False, facts=facts)
    peak, peak_node = 0, "start"
    for name, live in timeline:
        if live > peak:
            peak, peak_node = live, name
    return MemoryEstimate(int(peak), peak_node, int(out_bytes), int(tangent_bytes(gm)))


class PeakProbe:
    """``estimate_memory(gm, facts=facts).peak_bytes`` (default arguments: inputs never freed)
    of orders that differ from one base order within one stretch of positions, simulating only
    that stretch: what the schedule pass asks for every move it tries.

    The base is the graph's order when the probe is built. ``peak_bytes(first, count)`` is the
    estimate once the caller has permuted the nodes at base positions ``first .. first + count
    - 1`` among themselves (nothing outside them moved). Before the stretch the simulation is
    the base's; after it, it is the base's too: the same nodes allocated there, and every buffer
    whose last use lies in the stretch still dies in it (its users outside the stretch did not
    move), as does every backend workspace whose wait lies in it. So the peak is the larger of
    the base's peaks before and after the stretch and the stretch simulated again, node by node
    as ``estimate_memory`` does (tests/test_cost_model.py compares the two on permuted graphs)."""

    def __init__(self, gm: fx.GraphModule, facts: NodeFacts):
        if facts.symbolic or len(facts.root) != len(gm.graph.nodes):
            raise ValueError("PeakProbe needs numeric NodeFacts of this graph's nodes")
        self.facts = facts
        self.nodes = nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(nodes)}
        outputs = set(facts.input_roots[nodes[-1]])
        self.last_use = last_use = _last_uses(nodes, facts.input_roots)
        self.dies = {r for r in last_use if r not in outputs and r.op != "placeholder"}
        frees: dict[int, list[fx.Node]] = {}
        for root in self.dies:
            frees.setdefault(last_use[root], []).append(root)
        # live bytes entering each position, the backend workspaces pending there, and the
        # live bytes right after each node allocated
        self.enter, self.pending_in, after = [], [], []
        pending: dict[fx.Node, int] = {}
        for node, (before, allocated) in zip(nodes, _simulate(nodes, facts, frees, 0, pending)):
            self.enter.append(before)
            after.append(allocated)
            # the workspaces held on entry (_simulate has added this node's own already)
            self.pending_in.append(tuple((c, w) for c, w in pending.items() if c is not node) if pending else ())
        self.prefix_peak = [0]  # the peak before each position (estimate_memory starts at 0)
        for value in after:
            self.prefix_peak.append(max(self.prefix_peak[-1], value))
        self.suffix_peak = [0] * (len(nodes) + 1)  # the peak from each position on
        for i in range(len(nodes) - 1, -1, -1):
            self.suffix_peak[i] = max(self.suffix_peak[i + 1], after[i])

    def peak_bytes(self, first: int, count: int) -> int:
        facts, last_use, dies = self.facts, self.last_use, self.dies
        if first < 1 or first + count > len(self.nodes):
            raise ValueError(f"stretch {first}..{first + count - 1} is not inside the graph after its first node")
        stretch, node = [], self.nodes[first - 1].next
        for _ in range(count):
            stretch.append(node)
            node = node.next
        end = first + count - 1
        frees: dict[int, list[fx.Node]] = {}
        dying = {}
        for j, node in enumerate(stretch):
            for root in facts.input_roots[node]:
                if root in dies and first <= last_use[root] <= end:
                    dying[root] = j
        for root, j in dying.items():
            frees.setdefault(j, []).append(root)
        peak = max(self.prefix_peak[first], self.suffix_peak[end + 1])
        for _, live in _simulate(stretch, facts, frees, self.enter[first], dict(self.pending_in[first])):
            if live > peak:
                peak = live
        return int(peak)


def memory_timeline(
    gm: fx.GraphModule,
    inputs_freed_at_last_use: bool = False,
    owned_inputs: Iterable[str] | None = None,
    *,
    symbolic: bool = False,
) -> tuple[list[tuple[str, Any]], Any]:
    """``estimate_memory``'s simulation node by node: ``[(node name, live bytes)]`` and the
    output bytes; with ``symbolic=True`` sympy expressions in the graph's size symbols (what
    ``zerofx.plan`` solves for the largest batch and sequence that fit)."""
    return _liveness(gm, inputs_freed_at_last_use, owned_inputs, symbolic)


def tangent_bytes(gm: fx.GraphModule, symbolic: bool = False) -> Any:
    """Bytes of a backward graph's incoming gradients (placeholders named ``tangents_*``, as torch's
    partitioners tell them apart). The backward that runs first gets them from the autograd engine,
    allocated at its start (the loss's gradient, and zeros for every output the loss does not use,
    such as a model's returned logits); later ones get them from the backward before them."""
    zero: Any = sympy.Integer(0) if symbolic else 0
    tangents = [n for n in gm.graph.nodes if n.op == "placeholder" and "tangents" in str(n.target)]
    return sum((tensor_bytes(n.meta.get("val"), symbolic) for n in tangents), zero)


def predict_step_peak(estimates: dict[tuple[str, str], MemoryEstimate], graph_ids: list[str]) -> int:
    """Predicted peak bytes of forward + backward above the step's start, for frames run in
    ``graph_ids`` order (backwards run in reverse), from each final graph's ``estimate_memory``
    (``estimates``: ``(graph_id, kind) -> MemoryEstimate``, what a compile keeps): each
    forward's transient peak on top of what earlier forwards saved, then each backward's peak
    on top of what is still saved (a backward releases its frame's saved tensors only when it
    returns; the first backward also holds the gradients the engine hands it, ``tangent_bytes``)."""
    live = peak = 0
    for gid in graph_ids:
        fw = estimates[(gid, "forward")]
        peak = max(peak, live + fw.peak_bytes)
        live += fw.output_bytes
    for i, gid in enumerate(reversed(graph_ids)):
        bw = estimates[(gid, "backward")]
        peak = max(peak, live + (bw.tangent_bytes if i == 0 else 0) + bw.peak_bytes)
        live += bw.output_bytes - estimates[(gid, "forward")].output_bytes
    return peak


# ---------------------------------------------------------------------------------- device --


@dataclass(frozen=True)
class DeviceModel:
    """The one device-rate model: what turns FLOPs and bytes into seconds, for every decision
    (schedule: compute between collectives; checkpoint: recompute vs transfer; offload: how
    early a reload must start) and every report.

    The rates are deliberately round: the decisions they feed (does a copy hide behind compute?
    is recompute cheaper than a transfer? how much compute covers a collective?) only need the
    right order of magnitude. The defaults describe a modern accelerator; ``for_device("cpu")``
    one CPU core."""

    flops_per_s: float = 100e12  # matmul-class throughput
    memory_bytes_per_s: float = 2e12  # device memory bandwidth (the roofline's other side)
    op_overhead_s: float = 5e-6  # per op: a kernel launch, or the interpreter's dispatch on a CPU
    host_link_bytes_per_s: float = 20e9  # device <-> pinned host memory (PCIe-class)
    disk_bytes_per_s: float = 2e9  # host <-> NVMe

    @classmethod
    def preset(cls, name: str) -> DeviceModel:
        """Round datasheet rates of a device by name (``PRESETS``: bf16 dense matmul FLOP/s, memory
        bandwidth; the host link as its PCIe generation): what ``zerofx plan --device`` prices a
        step with. Real kernels reach a fraction of these, so predicted times are lower bounds."""
        if name == "cpu":
            return cls.for_device("cpu")
        if name not in PRESETS:
            raise ValueError(f"unknown device {name!r}; known: cpu, {', '.join(sorted(PRESETS))}")
        return cls(**PRESETS[name])

    @classmethod
    def for_device(cls, device_type: str) -> DeviceModel:
        if device_type == "cpu":
            # one core's matmul throughput; host "transfers" are memcpys; disk as NVMe
            return cls(
                flops_per_s=50e9,
                memory_bytes_per_s=5e9,
                op_overhead_s=4e-6,
                host_link_bytes_per_s=10e9,
                disk_bytes_per_s=2e9,
            )
        return cls()

    def compute_s(self, flops: float) -> float:
        return flops / self.flops_per_s

    def transfer_s(self, nbytes: float, tier: str) -> float:
        rate = self.disk_bytes_per_s if tier == "disk" else self.host_link_bytes_per_s
        return nbytes / rate

    def node_time(self, node: fx.Node) -> float:
        """Roofline time of one op: the larger of its FLOPs and its bytes moved, plus overhead."""
        if node.op != "call_function" or is_alias(node) or node.target in COLLECTIVE_OPS:
            return 0.0
        moved = allocated_bytes(node) + sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        return max(node_flops(node) / self.flops_per_s, moved / self.memory_bytes_per_s) + self.op_overhead_s


PRESETS: dict[str, dict[str, float]] = {
    "a100": dict(flops_per_s=312e12, memory_bytes_per_s=2.0e12, host_link_bytes_per_s=25e9, disk_bytes_per_s=3e9),
    "h100": dict(flops_per_s=989e12, memory_bytes_per_s=3.35e12, host_link_bytes_per_s=50e9, disk_bytes_per_s=5e9),
    "h200": dict(flops_per_s=989e12, memory_bytes_per_s=4.8e12, host_link_bytes_per_s=50e9, disk_bytes_per_s=5e9),
}


# --------------------------------------------------------------------------- communication --


@dataclass(frozen=True)
class CommModel:
    """``latency_s + wire_bytes * seconds_per_byte`` per collective, per rank."""

    latency_s: float = 2.5e-4
    seconds_per_byte: float = 1e-9

    def time(self, wire: float) -> float:
        return self.latency_s + wire * self.seconds_per_byte

    def node_time(self, node: fx.Node) -> float:
        spec = COLLECTIVE_OPS.get(node.target)
        if spec is None:
            return 0.0
        sized = node if spec.sized == "out" else node.args[0]
        return self.time(
            wire_bytes(
                collective_kind(node), tensor_bytes(sized.meta.get("val")), collective_group_size(spec, node.args)
            )
        )

    @property
    def saturating_bytes(self) -> int:
        """Wire bytes at which latency is a fifth of a collective's time: a good bucket size."""
        return int(4 * self.latency_s / self.seconds_per_byte)


@dataclass(frozen=True)
class TimeEstimate:
    """One graph's step time on two streams: compute in graph order, collectives in issue order."""

    total_s: float  # when the last op (compute or collective) finishes
    compute_s: float  # the roofline time of every compute op
    comm_s: float  # every collective's time, hidden or not

    @property
    def exposed_comm_s(self) -> float:
        """Communication compute did not hide: what the schedule left on the critical path."""
        return self.total_s - self.compute_s


def estimate_time(gm: fx.GraphModule, device: DeviceModel, comm_for: Any) -> TimeEstimate:
    """Simulate ``gm`` on a compute stream and a communication stream: a compute op runs after the
    previous one (``device.node_time``); a collective starts when it is issued and the previous
    collective is done (``comm_for(group_name).node_time``); a wait holds compute until its
    collective is done. So the exposed communication is what the pass pipeline's order (bucket,
    schedule) leaves uncovered, on these rates."""
    clock = free = compute = comm = 0.0
    done: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        spec = COLLECTIVE_OPS.get(node.target) if node.op == "call_function" else None
        if spec is not None:
            took = comm_for(node.args[spec.group_name_arg]).node_time(node)
            free = max(clock, free) + took
            done[node] = free
            comm += took
        elif node.op == "call_function" and node.target is WAIT:
            clock = max(clock, done.get(node.args[0], 0.0))
        else:
            took = device.node_time(node)
            clock += took
            compute += took
    return TimeEstimate(max(clock, free), compute, comm)


def graph_device_type(gm: fx.GraphModule) -> str:
    """The device type of a graph's tensor inputs ("cpu" when it has none)."""
    return next(
        (
            n.meta["val"].device.type
            for n in gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        ),
        "cpu",
    )


@dataclass(frozen=True)
class CostModel:
    """Device rates plus collective constants: what every pass prices its decisions with
    (``PassContext.cost``). ``device=None`` takes each graph's own device's defaults."""

    comm: CommModel = field(default_factory=CommModel)
    device: DeviceModel | None = None

    def device_for(self, gm_or_type: fx.GraphModule | str) -> DeviceModel:
        if self.device is not None:
            return self.device
        kind = gm_or_type if isinstance(gm_or_type, str) else graph_device_type(gm_or_type)
        return DeviceModel.for_device(kind)


def _cache_path(backend: str, world_size: int) -> Path:
    root = Path(os.environ.get("ZEROFX_CACHE_DIR", Path.home() / ".cache" / "zerofx"))
    return root / f"comm-{backend}-w{world_size}.json"


def calibrate_comm(
    group: torch.distributed.ProcessGroup | None = None,
    *,
    device: str = "cpu",
    use_cache: bool = True,
    repeats: int = 7,
) -> CommModel:
    """Measure all-gather latency and bandwidth on ``group`` (a collective: every rank calls it).

    Two sizes, median of ``repeats`` runs each, the slowest rank's times (so every rank derives
    the same constants and makes the same decisions: collectives must be issued in the same
    order everywhere). The result is cached per backend and world size; every rank loads the
    cache only if every rank has it.
    """
    import torch.distributed as dist

    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    path = _cache_path(backend, world)
    have = torch.tensor([1 if (use_cache and path.exists()) else 0])
    dist.all_reduce(have, op=dist.ReduceOp.MIN, group=group)
    if have.item():
        # rank 0's file for everyone (tensors: object collectives need NumPy)
        values = torch.zeros(2, dtype=torch.float64)
        if dist.get_rank(group) == 0:
            cached = json.loads(path.read_text())
            values = torch.tensor([cached["latency_s"], cached["seconds_per_byte"]], dtype=torch.float64)
        dist.broadcast(values, group_src=0, group=group)
        return CommModel(latency_s=values[0].item(), seconds_per_byte=values[1].item())

    def measure(numel: int) -> float:
        x = torch.ones(numel, device=device)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            start = time.perf_counter()
            out = all_gather(x, world, group.group_name)
            torch.ops._c10d_functional.wait_tensor(out)
            times.append(time.perf_counter() - start)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.item()

    small, large = 256, 1 << 20  # elements
    t_small, t_large = measure(small), measure(large)
    share = (world - 1) / world
    per_byte = max((t_large - t_small) / ((large - small) * 4 * world * share), 1e-12)
    latency = max(t_small - small * 4 * world * share * per_byte, 1e-6)
    model = CommModel(latency_s=latency, seconds_per_byte=per_byte)
    if use_cache and dist.get_rank(group) == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(model)))
        tmp.replace(path)
    dist.barrier(group=group)  # the cache exists for every rank's next look
    return model
