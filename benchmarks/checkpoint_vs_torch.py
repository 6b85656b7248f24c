"""zerofx's activation budget against torch's memory-budget partitioner, on the same graph.

For the benchmark GPT, one joint forward+backward graph is captured (after zerofx's ``regather``
pass) and partitioned two ways at the same activation budgets, 100 / 50 / 25% of the
unconstrained saved-activation bytes (what the forward saves when nothing that costs FLOPs is
recomputed):

* zerofx: ``checkpoint_pass`` with ``activation_budget=<bytes>`` (the min-cut priced in FLOPs,
  see passes/activation_plan.py), cut by ``partition_by_plan``;
* torch: ``min_cut_rematerialization_partition`` with ``activation_memory_budget=b`` (knapsack
  over the ops its heuristics ban from recompute, then a min-cut on bytes). Its knob is a
  fraction of its own range, not of our bytes, so it is bisected for the largest value whose
  partition saves no more bytes than the budget (and also shown at the literal value).

Both are counted by the same code: saved-activation bytes of the forward graph
(``cost_model.saved_activation_bytes``) and recompute FLOPs = FLOPs the backward graph spends on
forward ops (``cost_model.op_flops``, matmul formulas from torch.utils.flop_counter plus one FLOP
per element for other ops; the RNG-state wrappers torch puts around recomputed attention are
counted as the op they wrap). Then each partition is run for real under
``zerofx.MemoryTracker``: measured saved-activation peak and measured backward FLOPs.

    python benchmarks/checkpoint_vs_torch.py [--layers N] [--json out.json]   # default: GPTConfig()

Prints a table and a JSON document (also written to --json).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time

import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import classify_nodes, min_cut_rematerialization_partition

import zerofx
from zerofx.backend import make_backend
from zerofx.models import GPT, GPTConfig, random_batch
from zerofx.passes.checkpoint import checkpoint_pass, partition_by_plan
from zerofx.passes.cost_model import op_flops, saved_activation_bytes
from zerofx.passes.pipeline import PassContext, run_pipeline

BUDGETS = (1.0, 0.5, 0.25)


def clone(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy sharing fake-tensor metadata (so buffer identity survives)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    new_out = graph.output(out)
    old_out = next(n for n in gm.graph.nodes if n.op == "output")
    new_out.meta = copy.copy(old_out.meta)
    return fx.GraphModule(gm, graph)


def capture_joint(model: torch.nn.Module, batch) -> tuple[fx.GraphModule, int, dict]:
    """The joint graph zerofx's backend partitions, after the joint passes before the checkpoint
    pass (which is left to the caller: by default it would tag the graph with its own plan)."""
    captured = []

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        ctx = PassContext("bench", "joint", zerofx.Options(), num_fwd_outputs=num_fwd_outputs)
        joint = run_pipeline(joint, ctx, disabled=("checkpoint",))
        captured.append((clone(joint), num_fwd_outputs, kwargs))
        return min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    noop = lambda gm, _: make_boxed_func(gm)  # noqa: E731
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=noop, bw_compiler=noop, partition_fn=partition))
    fn(*batch).backward()
    torch._dynamo.reset()
    ((joint, n, kwargs),) = captured
    return joint, n, kwargs


def recompute_flops(bw: fx.GraphModule, forward_names: set[str]) -> int:
    """FLOPs the backward graph spends recomputing forward values."""
    total = 0
    for node in bw.graph.nodes:
        if node.op != "call_function":
            continue
        target, args = node.target, node.args
        if getattr(target, "__name__", "") == "run_with_rng_state":  # torch's wrapper: (state, op, *args)
            target, args = args[1], args[2:]
        elif node.name not in forward_names:
            continue
        vals = fx.node.map_aggregate(args, lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)
        kw = fx.node.map_aggregate(node.kwargs, lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)
        total += op_flops(target, vals, kw, node.meta.get("val"))
    return total


def evaluate(fw: fx.GraphModule, bw: fx.GraphModule, n: int, forward_names: set[str]) -> dict:
    return {"saved_bytes": saved_activation_bytes(fw, n), "recompute_flops": recompute_flops(bw, forward_names)}


def torch_partition(joint, n, kwargs, knob: float):
    with functorch_config.patch(activation_memory_budget=knob):
        return min_cut_rematerialization_partition(clone(joint), None, num_fwd_outputs=n, **kwargs)


def zerofx_partition(joint, n, kwargs, budget_bytes: int):
    gm = clone(joint)
    ctx = PassContext("bench", "joint", zerofx.Options(activation_budget=budget_bytes), num_fwd_outputs=n)
    gm = checkpoint_pass(gm, ctx)
    return partition_by_plan(gm, n, kwargs.get("static_lifetime_input_indices"))


def torch_knob_for(joint, n, kwargs, budget_bytes: int, forward_names) -> tuple[float, dict]:
    """Largest activation_memory_budget whose partition saves <= budget_bytes (bisection)."""
    lo, hi = 0.0, 1.0
    best = evaluate(*torch_partition(joint, n, kwargs, 0.0), n, forward_names)
    top = evaluate(*torch_partition(joint, n, kwargs, 1.0), n, forward_names)
    if top["saved_bytes"] <= budget_bytes:
        return 1.0, top
    for _ in range(14):
        mid = (lo + hi) / 2
        result = evaluate(*torch_partition(joint, n, kwargs, mid), n, forward_names)
        if result["saved_bytes"] <= budget_bytes:
            lo, best = mid, result
        else:
            hi = mid
    return lo, best


def measure(model_fn, batch, options: dict, knob: float | None = None) -> dict:
    """Compile and run one step under MemoryTracker (the second step: the first compiles)."""
    model = model_fn()
    model.compile(backend=make_backend(zerofx.Options(**options)))
    with functorch_config.patch(activation_memory_budget=1.0 if knob is None else knob):
        model(*batch).backward()
    with zerofx.MemoryTracker() as mem:
        model(*batch).backward()
    torch._dynamo.reset()
    return {"measured_activation_bytes": mem.activation_peak, "measured_backward_flops": mem.flops["backward"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=GPTConfig().n_layer)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=4, d_model=args.d_model)
    batch = random_batch(cfg, args.batch, torch.Generator().manual_seed(0))

    def model_fn():
        torch.manual_seed(0)
        return zerofx.shard(GPT(cfg), torch.distributed.device_mesh.init_device_mesh("cpu", (1,)))

    started = time.perf_counter()
    joint, n, kwargs = capture_joint(model_fn(), batch)
    info = classify_nodes(joint, [], n)
    forward_names = {node.name for node in joint.graph.nodes if info.is_required_fw(node)}
    backward_only = sum(
        op_flops(
            node.target,
            fx.node.map_aggregate(node.args, lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a),
            {},
            node.meta.get("val"),
        )
        for node in joint.graph.nodes
        if node in info.tangents_closure and node.op == "call_function"
    )
    unconstrained = evaluate(*zerofx_partition(joint, n, kwargs, 10**15), n, forward_names)["saved_bytes"]
    rows = []
    for fraction in BUDGETS:
        budget = int(fraction * unconstrained)
        ours = evaluate(*zerofx_partition(joint, n, kwargs, budget), n, forward_names)
        ours |= measure(model_fn, batch, {"activation_budget": budget})
        knob, theirs = torch_knob_for(joint, n, kwargs, budget, forward_names)
        theirs |= measure(model_fn, batch, {"disable_passes": ("checkpoint",)}, knob)  # torch cuts
        literal = evaluate(*torch_partition(joint, n, kwargs, fraction), n, forward_names)
        for who, r in (("zerofx", ours), ("torch", theirs)):
            r["measured_recompute_flops"] = r["measured_backward_flops"] - backward_only
        rows.append(
            {
                "budget_fraction": fraction,
                "budget_bytes": budget,
                "zerofx": ours,
                "torch": {"activation_memory_budget": knob, **theirs},
                "torch_literal_knob": {"activation_memory_budget": fraction, **literal},
            }
        )
    result = {
        "model": {
            "layers": args.layers,
            "d_model": args.d_model,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "params": sum(p.numel() for p in GPT(cfg).parameters()),
        },
        "unconstrained_saved_bytes": unconstrained,
        "backward_only_flops": backward_only,
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(
        f"GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}, batch {args.batch}: unconstrained "
        f"saved activations {unconstrained} B"
    )
    header = (
        f"{'budget':>7} {'bytes':>9} | {'zerofx saved':>12} {'measured':>9} {'recompute FLOP':>15} "
        f"{'measured':>12} | {'torch knob':>10} {'saved':>9} {'measured':>9} {'recompute FLOP':>15} "
        f"{'measured':>12} | {'torch@knob=budget':>22}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        z, t, lit = r["zerofx"], r["torch"], r["torch_literal_knob"]
        print(
            f"{r['budget_fraction']:>6.0%} {r['budget_bytes']:>9} | {z['saved_bytes']:>12} {z['measured_activation_bytes']:>9} "
            f"{z['recompute_flops']:>15,} {z['measured_recompute_flops']:>12,} | "
            f"{t['activation_memory_budget']:>10.4f} {t['saved_bytes']:>9} {t['measured_activation_bytes']:>9} "
            f"{t['recompute_flops']:>15,} {t['measured_recompute_flops']:>12,} | "
            f"{lit['saved_bytes']:>8} B {lit['recompute_flops']:>11,} F"
        )
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
