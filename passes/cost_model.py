"""One cost model for every decision zerofx makes: memory, compute and communication.

Bucketing, prefetch scheduling and selective unsharding all read this module, so a decision
can be explained ("this all-gather moves 96 KiB, estimated 0.31 ms; the compute it hides
behind is estimated 0.45 ms") and predicted before anything runs.

Memory comes from fake-tensor metadata (``node.meta["val"]``). Sizes are symbolic where the
graph is: ``node_bytes(node, symbolic=True)`` returns a sympy expression over the graph's size
symbols; every decision uses the concrete hint.

Communication is ``latency + wire_bytes * seconds_per_byte`` per collective (wire bytes per
rank, see zerofx.metrics NOTE: counting collective bytes), with constants measured on the
actual process group by ``calibrate_comm`` and cached per (backend, world size).

Compute is a roofline: ``max(flops / flops_per_s, bytes / bytes_per_s) + per-op overhead``.
The defaults fit one CPU core; ``calibrate_compute`` measures them.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import sympy
import torch
from torch import fx

from zerofx.metrics import COLLECTIVE_OPS, collective_group_size, wire_bytes

aten = torch.ops.aten
WAIT = torch.ops._c10d_functional.wait_tensor.default


# ---------------------------------------------------------------------------------- memory --

def _size(value: int | torch.SymInt, symbolic: bool):
    if isinstance(value, torch.SymInt):
        return value.node.expr if symbolic else value.node.hint
    return sympy.Integer(value) if symbolic else value


def tensor_bytes(val: object, symbolic: bool = False):
    """Bytes of a (fake) tensor, or of every tensor in a tuple/list of them."""
    if isinstance(val, (tuple, list)):
        return sum((tensor_bytes(v, symbolic) for v in val), sympy.Integer(0) if symbolic else 0)
    if not isinstance(val, torch.Tensor):
        return sympy.Integer(0) if symbolic else 0
    numel = math.prod(_size(s, symbolic) for s in val.shape) if val.dim() else 1
    return numel * val.element_size()


def is_alias(node: fx.Node) -> bool:
    """Nodes whose output shares an input's storage allocate nothing: views, waits, and
    in-place or ``out=`` ops (their schema's return carries an alias annotation)."""
    if node.op != "call_function":
        return False
    if node.target is WAIT:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return node.target.is_view or (len(returns) == 1 and returns[0].alias_info is not None)


def node_bytes(node: fx.Node, symbolic: bool = False):
    """Bytes newly allocated by ``node`` (0 for views and waits)."""
    if is_alias(node) or node.op != "call_function":
        return sympy.Integer(0) if symbolic else 0
    return tensor_bytes(node.meta.get("val"), symbolic)


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage an aliasing node returns (``out=`` for out variants)."""
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None


def _storage_root(node: fx.Node) -> fx.Node:
    while is_alias(node) and _aliased_input(node) is not None:
        node = _aliased_input(node)
    return node


@dataclass(frozen=True)
class MemoryEstimate:
    """Liveness simulation of one graph, in graph order."""

    peak_bytes: int  # most bytes allocated by the graph at once (inputs excluded unless freed)
    peak_node: str  # the node at which that happened
    output_bytes: int  # bytes still alive at the end that the graph allocated (its outputs)


def estimate_memory(gm: fx.GraphModule, inputs_freed_at_last_use: bool = False) -> MemoryEstimate:
    """Simulate allocation and freeing of ``gm``'s values in graph order.

    Values die after their last use (FX's generated code drops them then), except graph
    outputs. Aliases (views, waits, in-place ops) keep their storage root alive. A
    collective's output is allocated when it is issued. Inputs are not counted and, by
    default, not freed (a forward's inputs are parameters and user data held elsewhere). With
    ``inputs_freed_at_last_use`` (a backward run with the boxed calling convention, which
    drops each saved tensor at its last use) they start counted and are freed at last use; the
    result is then relative to the live bytes before the graph.
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    outputs = {_storage_root(a) for a in output.all_input_nodes}
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            root = _storage_root(inp)
            last_use[root] = max(last_use.get(root, -1), order[node])
    live = 0
    peak, peak_node = 0, "start"
    if inputs_freed_at_last_use:
        live = sum(tensor_bytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    frees: dict[int, list[fx.Node]] = {}
    for root, idx in last_use.items():
        if root not in outputs and (root.op != "placeholder" or inputs_freed_at_last_use):
            frees.setdefault(idx, []).append(root)
    baseline = live
    for node in nodes:
        live += node_bytes(node)
        if live - baseline > peak:
            peak, peak_node = live - baseline, node.name
        for dead in frees.get(order[node], ()):
            live -= tensor_bytes(dead.meta.get("val")) if dead.op == "placeholder" else node_bytes(dead)
    out_bytes = sum(node_bytes(r) for r in outputs if r.op == "call_function")
    return MemoryEstimate(int(peak), peak_node, int(out_bytes))


# --------------------------------------------------------------------------------- compute --

def node_flops(node: fx.Node) -> int:
    """Floating-point operations of one ATen node (matmuls and attention exactly, others ~numel)."""
    if node.op != "call_function" or is_alias(node) or node.target in COLLECTIVE_OPS:
        return 0
    t = node.target
    vals = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    shape = lambda v: [int(_size(s, False)) for s in v.shape]  # noqa: E731
    if t is aten.mm.default:
        (m, k), (_, n) = shape(vals[0]), shape(vals[1])
        return 2 * m * n * k
    if t is aten.addmm.default:
        (m, k), (_, n) = shape(vals[1]), shape(vals[2])
        return 2 * m * n * k
    if t in (aten.bmm.default, aten.baddbmm.default):
        a, b = (vals[0], vals[1]) if t is aten.bmm.default else (vals[1], vals[2])
        (bs, m, k), (_, _, n) = shape(a), shape(b)
        return 2 * bs * m * n * k
    name = str(t)
    if "scaled_dot_product" in name:
        q, k = shape(vals[0]), shape(vals[1])
        batch = math.prod(q[:-2])
        flops = 4 * batch * q[-2] * k[-2] * q[-1]
        return flops * 2 if "backward" in name else flops
    val = node.meta.get("val")
    return tensor_bytes(val) // val.element_size() if isinstance(val, torch.Tensor) else 0


@dataclass(frozen=True)
class ComputeModel:
    """Roofline estimate of one op's time on this rank's device."""

    flops_per_s: float = 2e10
    bytes_per_s: float = 5e9
    op_overhead_s: float = 4e-6

    def node_time(self, node: fx.Node) -> float:
        if node.op != "call_function" or is_alias(node) or node.target in COLLECTIVE_OPS:
            return 0.0
        moved = node_bytes(node) + sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        return max(node_flops(node) / self.flops_per_s, moved / self.bytes_per_s) + self.op_overhead_s


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
        return self.time(wire_bytes(spec.kind, tensor_bytes(sized.meta.get("val")),
                                    collective_group_size(spec, node.args)))

    @property
    def saturating_bytes(self) -> int:
        """Wire bytes at which latency is a fifth of a collective's time: a good bucket size."""
        return int(4 * self.latency_s / self.seconds_per_byte)


@dataclass(frozen=True)
class CostModel:
    compute: ComputeModel = ComputeModel()
    comm: CommModel = CommModel()

    def node_time(self, node: fx.Node) -> float:
        if node.target in COLLECTIVE_OPS:
            return self.comm.node_time(node)
        return self.compute.node_time(node)


def _cache_path(backend: str, world_size: int) -> Path:
    root = Path(os.environ.get("ZEROFX_CACHE_DIR", Path.home() / ".cache" / "zerofx"))
    return root / f"comm-{backend}-w{world_size}.json"


def calibrate_comm(group: torch.distributed.ProcessGroup | None = None, *, device: str = "cpu",
                   use_cache: bool = True, repeats: int = 7) -> CommModel:
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
            out = torch.ops._c10d_functional.all_gather_into_tensor(x, world, group.group_name)
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
