"""checkpoint: choose what the backward gets saved, recomputed or reloaded, under one budget.

Runs on the joint graph, after ``regather`` (which marks every gathered parameter MUST_RECOMPUTE).
It turns the user's options into constraints, asks ``activation_plan`` for the cheapest plan
that fits the activation budget, and writes the plan into the graph as the partitioner's own
vocabulary: every forward node the backward re-runs is tagged MUST_RECOMPUTE, every other
forward node MUST_SAVE (a ban on recomputing it), and saved values chosen for offload carry
``meta[OFFLOAD_TIER] = "host" | "disk"`` (read by the offload pass on the partitioned
graphs; node meta travels with the partitioner's copies). With every forward node tagged the
min-cut partitioner has no choice left: it would cut exactly where the plan says.

The backend does not even ask it to: ``partition_by_plan`` hands the plan's saved values to
torch's own graph extraction (``_extract_fwd_bwd_modules``, the second half of
``min_cut_rematerialization_partition``), then checks the result against the plan. Going
around the min-cut half matters for one case: ops that are tagged random only because they
*could* apply dropout (CPU flash attention with ``dropout_p=0``) are deterministic, yet the
partitioner would wrap their recompute in RNG-state save/restore, saving a 5 KiB CPU generator
state per op the plan did not budget for. If torch's private helpers move, the tags alone still
make the stock partitioner produce the plan (with that RNG-state caveat).

Policies (``zerofx.Options``), combinable with a budget:

    activation_budget=0.5          fraction of the unconstrained saved-activation bytes, or bytes
    checkpoint="full"              recompute everything inside each block; save block boundaries
    checkpoint_modules=("blocks.1", "blocks.*.attn")
                                   the same for the modules these patterns name
    checkpoint_save_ops=("aten.mm",)
                                   always save these ops' outputs (inside checkpointed modules, or
                                   everywhere when no module is checkpointed and no budget is set:
                                   then everything else is recomputed, torch's selective AC)
    offload_activations="disk"     park saved values in host memory / on disk where it pays

# NOTE: ranks agree
Every rank compiles its own graphs, and a plan decides which parameters the backward re-gathers
(a recomputed matmul needs its weight again): two ranks with different plans would issue
different all-gathers and hang. So the planner is deterministic (it iterates in graph order,
never over sets of nodes), and on more than one rank the checkpoint pass also compares plans:
every rank sends a hash of its graph's structure and its decision (positions of the recomputed
and offloaded nodes) with an all-gather of the pickled plans over the parameters' process group, and adopts rank
0's decision when they differ (they can, legitimately: uneven shards make slightly different
byte counts). Graphs that differ in structure across ranks are an error, as the collectives
would not match either. Structure is ops in graph order, not node names, and leaves out size
inputs nothing reads: a rank whose batch is a view at an offset (its rows of a global batch)
traces that offset as a symbol of its own, which renumbers its nodes. torch's partitioner does
the same (``_sync_decision_cross_ranks``).

# NOTE: blocks
A "block" is the outermost module whose qualified name ends in an index (``blocks.0``,
``layers.11``: the children of a ModuleList or Sequential, i.e. transformer layers). A model
without such modules uses the root's direct children. A node belongs to the block (or to the
checkpointed module) in its ``nn_module_stack``; a value produced in one region and read in
another (or outside all regions) is a boundary and is saved, like the output of a
``torch.utils.checkpoint`` region. Code outside every region is left to the plan.

# NOTE: checkpoint calls in the model
A model that calls ``torch.utils.checkpoint`` itself (its own blocks, or layers whose own
checkpointing zerofx.compile did not take over: zerofx/layer_checkpointing.py) reaches the joint
graph with that call's ops tagged PREFER_RECOMPUTE and numbered by call (``ac_graph_id``).
torch's partitioner treats "prefer" as a hint; so would this pass's plan, which left such a model
saving what it saves without the call: the user's checkpointing silently undone. So each call is a
region like a checkpointed module's: what its ops compute is recomputed, what leaves it is saved,
and what the user's selective policy marked MUST_SAVE stays saved. PREFER_SAVE is left to the plan.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import fx
from torch._functorch import config as functorch_config
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import NodeInfo, classify_nodes, is_sym_node
from torch.utils.checkpoint import CheckpointPolicy

from zerofx.errors import ZeroFXError, some_names
from zerofx.ir.markers import UNSHARD
from zerofx.ir.meta import AC_REGION, ACTIVATION_PLAN, OFFLOAD_TIER, RECOMPUTE, ROLE
from zerofx.options import MemoryPolicy, closest
from zerofx.passes.activation_plan import ActivationPlan, PlanProblem, cannot_recompute, plan_activations
from zerofx.passes.contract import Pass, PassContext
from zerofx.passes.cost_model import is_alias, node_bytes
from zerofx.passes.graph import positions
from zerofx.passes.modules import block_of, module_path

__all__ = [
    "checkpoint_pass",
    "partition_by_plan",
    "module_path",
    "wants_plan",
    "format_bytes",
    "format_flops",
    "check_module_patterns",
]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_flops(n: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f} FLOP" if unit == "" else f"{n:.1f} {unit}FLOP"
        n /= 1000
    return f"{n} FLOP"


def wants_plan(options: MemoryPolicy) -> bool:
    """True when some option asks for a save/recompute/offload decision beyond the default."""
    return (
        options.activation_budget is not None
        or options.checkpoint == "full"
        or bool(options.checkpoint_modules)
        or bool(options.checkpoint_save_ops)
        or options.offload_activations != "none"
    )


def _paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [module_path(path) for path, _ in stack.values()]


def _op_matches(node: fx.Node, names: tuple[str, ...]) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    packet = f"{target.namespace}.{target._schema.name.split('::')[-1]}"
    spelled = {str(target), packet, packet.split(".", 1)[1]}
    return any(name in spelled for name in names)


def matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether the module path ``name`` matches one of the ``checkpoint_modules`` patterns."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def check_module_patterns(patterns: tuple[str, ...], model: torch.nn.Module) -> None:
    """Refuse ``checkpoint_modules`` patterns that match no module of ``model``: ``_regions``
    matches them against the module paths in each graph, where a misspelt pattern matches
    nothing and checkpoints nothing, silently. Checked on the whole model where it is compiled
    (a frame after a graph break holds only some modules, so no one graph can tell). A
    ``ModuleList`` or ``ModuleDict`` (``blocks``, HF's ``model.layers``) is never called itself,
    only its members are, so it appears in no graph's module paths: a pattern that matches only
    such containers would checkpoint nothing as well."""
    modules = list(model.named_modules(remove_duplicate=False))
    names = [name for name, _ in modules]
    # a container without a forward of its own (ModuleList, ModuleDict) is never called
    called = [name for name, m in modules if type(m).forward is not torch.nn.Module.forward]
    containers = [
        pat
        for pat in patterns
        if not any(matches(name, (pat,)) for name in called) and any(matches(name, (pat,)) for name in names)
    ]
    if containers:
        hints = ", ".join(f"{pat!r} (use {pat + '.*'!r} for its members)" for pat in containers)
        raise ZeroFXError(
            f"option checkpoint_modules: {hints} names only a ModuleList / ModuleDict, which is never called "
            "itself (its members are), so it would checkpoint nothing: name the members"
        )
    missing = [pat for pat in patterns if not any(matches(name, (pat,)) for name in names)]
    if not missing:
        return
    shallow_first = sorted((name for name in names if name), key=lambda name: name.count("."))
    hints = ", nor ".join(f"{pat!r}{closest(pat, names)}" for pat in missing)
    raise ZeroFXError(
        f"option checkpoint_modules: no module of {type(model).__name__} matches {hints}; patterns are "
        f"fnmatch patterns of the names in model.named_modules(), here {some_names(shallow_first, shown=6)}: "
        "fix or drop the pattern"
    )


def _regions(fw_nodes: list[fx.Node], options: MemoryPolicy) -> dict[fx.Node, str]:
    """Node -> the checkpointed region (module path) it belongs to (see NOTE: blocks), or the
    ``torch.utils.checkpoint`` call it was traced in (NOTE: checkpoint calls in the model)."""
    patterns = list(options.checkpoint_modules)
    if options.checkpoint == "full":
        all_paths = {p for n in fw_nodes for p in _paths(n)}
        indexed = {block_of(p) for p in all_paths if any(part.isdigit() for part in p.split("."))}
        patterns += sorted(indexed or {block_of(p) for p in all_paths})
    regions = {}
    for n in fw_nodes:
        for p in _paths(n):  # outermost first
            if matches(p, patterns):
                regions[n] = p
                break
        else:
            if n.meta.get(AC_REGION) is not None and n.meta.get(RECOMPUTE) == CheckpointPolicy.PREFER_RECOMPUTE:
                regions[n] = f"torch.utils.checkpoint call {n.meta[AC_REGION]}"
    return regions


def _alias_base(node: fx.Node) -> fx.Node:
    while is_alias(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _policy_constraints(
    gm: fx.GraphModule, info: NodeInfo, options: MemoryPolicy, budgeted: bool
) -> tuple[dict[fx.Node, str], dict[fx.Node, str]]:
    """(must recompute, must save), each node with the reason the report gives (``info``: the
    joint graph's forward / backward split, ``classify_nodes``)."""
    fw = [n for n in gm.graph.nodes if info.is_required_fw(n) and n.op == "call_function"]
    recompute: dict[fx.Node, str] = {}
    save: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if n.meta.get(RECOMPUTE) == CheckpointPolicy.MUST_RECOMPUTE:
            recompute[n] = (
                "gathered parameter: re-gathered in backward (regather pass)"
                if n.meta.get(ROLE) == "gather"
                else "tagged MUST_RECOMPUTE in the model"
            )
        elif n.meta.get(RECOMPUTE) == CheckpointPolicy.MUST_SAVE:
            # a view is never saved, its buffer is: the base carries the tag's meaning (a kept
            # gathered parameter's transpose is rebuilt for free from the kept parameter)
            why = "kept gathered parameter (keep_gathered_bytes)" if n.meta.get(ROLE) == "kept_gather" else None
            save[_alias_base(n)] = why or "tagged MUST_SAVE in the model"
    regions = _regions(fw, options)
    save_ops = tuple(options.checkpoint_save_ops)
    free_to_choose = lambda n: n not in recompute and n not in save and cannot_recompute(n) is None  # noqa: E731
    for n in fw:
        if not free_to_choose(n):
            continue
        region = regions.get(n)
        if region is not None:
            outside = [u for u in n.users if info.is_required_fw(u) and regions.get(u) != region]
            if outside:
                base = _alias_base(n)
                if base is n or (base in regions and regions[base] == region and free_to_choose(base)):
                    save[base] = f"boundary of checkpointed {region} (read by {outside[0].name})"
            elif save_ops and _op_matches(n, save_ops):
                save[n] = "policy: op in checkpoint_save_ops"
            elif not is_alias(n):
                recompute[n] = f"policy: inside checkpointed {region}"
        elif save_ops and _op_matches(n, save_ops):
            save[n] = "policy: op in checkpoint_save_ops"
        elif save_ops and not regions and not budgeted and not is_alias(n):
            recompute[n] = "policy: not in checkpoint_save_ops"
    return recompute, save


def _budget_bytes(budget, unconstrained: int) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, float):
        return int(budget * unconstrained)
    return int(budget)


def _describe(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{tuple(val.shape)} {str(val.dtype).replace('torch.', '')}"
    return type(val).__name__


def _report(
    ctx: PassContext,
    problem: PlanProblem,
    plan: ActivationPlan,
    unconstrained: ActivationPlan,
    lean: ActivationPlan,
    budget: int | None,
    reasons: dict[fx.Node, str],
) -> None:
    u = unconstrained.resident_bytes or 1
    pct = lambda b: f"{100 * b / u:.0f}%"  # noqa: E731
    head = f"budget {format_bytes(budget)} ({pct(budget)} of unconstrained)" if budget is not None else "no budget"
    ctx.report(
        f"activation plan: {head}; resident {format_bytes(plan.resident_bytes)} ({pct(plan.resident_bytes)}), "
        f"offloaded {format_bytes(plan.offloaded_bytes)}, recompute {format_flops(plan.recompute_flops)}; "
        f"minimum feasible budget {format_bytes(lean.resident_bytes)} ({pct(lean.resident_bytes)})"
    )
    ctx.report(
        f"predicted activation peak (saved for backward, resident): before "
        f"{format_bytes(unconstrained.resident_bytes)}, after {format_bytes(plan.resident_bytes)}"
    )
    for n in plan.saved:
        nbytes = problem.save_bytes(n)
        if n.op == "placeholder":
            why = "graph input: its owner keeps it alive (0 B extra)"
        elif n in problem.must_save:
            why = problem.must_save[n]
        elif problem.why_kept(n) is not None:
            why = f"cannot recompute: {problem.why_kept(n)}"
        else:
            why = reasons.get(
                n, f"keeping it is cheaper than recomputing ({format_flops(problem.flops[n])} for this node alone)"
            )
        ctx.report(f"  saved       {n.name:<32} {_describe(n):<24} {format_bytes(nbytes):>10}  {why}")
    for n, tier in plan.offloaded.items():
        cost = problem.offload_cost.get(n, 1.0)
        why = (
            "copies hide behind compute"
            if cost <= 1.0
            else f"exposed transfer ~{(cost - 1) / problem.device.flops_per_s * 1e6:.0f} us is worth its bytes"
        )
        ctx.report(
            f"  offloaded   {n.name:<32} {_describe(n):<24} {format_bytes(problem.save_bytes(n)):>10}  to {tier}: {why}"
        )
    for n in plan.recomputed:
        why = reasons.get(n) or f"frees memory; recompute costs {format_flops(problem.flops[n])}"
        ctx.report(f"  recomputed  {n.name:<32} {_describe(n):<24} {format_bytes(node_bytes(n)):>10}  {why}")


def _agree_across_ranks(
    gm: fx.GraphModule, problem: PlanProblem, plan: ActivationPlan, ctx: PassContext
) -> ActivationPlan:
    """Rank 0's decision on every rank (see NOTE: ranks agree)."""
    marker = next((n for n in gm.graph.nodes if n.target is UNSHARD), None)
    if marker is None:
        return plan  # no parameter collectives in this graph: plans cannot make ranks diverge
    import hashlib

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._mode_utils import no_dispatch

    group = _resolve_process_group(marker.args[2])
    if group.size() == 1:
        return plan
    if ctx.before_agreement is not None:  # every rank compiling, or every rank raising (zerofx/backend.py)
        ctx.before_agreement()
    # nodes by position, less unused size inputs: a rank whose input is a view at an offset (its
    # rows of one global batch) traces its storage offset as a symbol that nothing reads, which
    # renumbers every later symbol's nodes; the computation, and so the plan, is the same
    nodes = [n for n in gm.graph.nodes if not (n.op == "placeholder" and not n.users and is_sym_node(n))]
    index = {n: i for i, n in enumerate(nodes)}
    structure = hashlib.sha256(
        "/".join(f"{n.op}:{'' if n.op == 'placeholder' else n.target}" for n in nodes).encode()
    ).hexdigest()
    mine = (
        structure,
        sorted(index[n] for n in plan.backward_side if n in index),
        [index[n] for n in plan.offloaded],
    )
    # compile runs with torch's Python dispatcher on, which would route this blocking collective
    # through Python while holding the GIL; gloo's worker thread needs the GIL to release the
    # previous work's tensors: a deadlock. Plain dispatch releases the GIL as usual.
    with no_dispatch(), unset_fake_temporarily(), torch._C._DisablePythonDispatcher():
        # pickled bytes in uint8 tensors, not all_gather_object: object collectives need NumPy
        import pickle

        data = torch.tensor(list(pickle.dumps(mine)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
        longest = max(int(t.item()) for t in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(group.size())]
        dist.all_gather(chunks, padded, group=group)
        decisions = [pickle.loads(bytes(c[: int(n.item())].tolist())) for c, n in zip(chunks, sizes)]
    if any(d[0] != structure for d in decisions):
        raise ZeroFXError(
            "ranks traced structurally different joint graphs; their checkpoint plans (and "
            "collectives) cannot match. Compile the same model on every rank, with inputs of one "
            "kind: torch specializes a size of 1, and sizes equal to each other, even under "
            "dynamic=True, so a rank given a batch of one sequence or a square input traces "
            "another graph (or train without an activation budget or checkpoint policy: the "
            "default plan is each rank's own)."
        )
    first = decisions[0]
    if first[1:] == mine[1:]:
        return plan
    return problem._account({nodes[i] for i in first[1]}, plan.price, {nodes[i] for i in first[2]})


def checkpoint_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Decide save / recompute / offload for every value the backward reads, under the budget
    (with no option asking for more: recompute what is cheap, NOTE: cheap recompute)."""
    options = ctx.options.memory
    if ctx.num_fwd_outputs is None:
        return gm
    if functorch_config.cse:  # plan on the graph the partitioner will cut (it runs CSE first)
        gm.graph = fx_graph_cse(gm.graph)
    gm.graph.eliminate_dead_code()
    if not wants_plan(options):
        return _cheap_recompute(gm, ctx)
    device = ctx.cost.device_for(gm)
    tier = None if options.offload_activations == "none" else options.offload_activations

    base = PlanProblem(
        gm,
        ctx.num_fwd_outputs,
        device=device,
        must_recompute=[n for n in gm.graph.nodes if n.meta.get(ROLE) == "gather"],
    )
    if not base.info.required_bw_nodes:
        return gm  # inference-only joint: nothing to save
    low, high = base.price_bounds()
    unconstrained = base.solve(high)
    budget = _budget_bytes(options.activation_budget, unconstrained.resident_bytes)
    recompute, save = _policy_constraints(gm, base.info, options, budget is not None)
    problem = PlanProblem(
        gm,
        ctx.num_fwd_outputs,
        must_recompute=recompute,
        must_save=save,
        offload_tier=tier,
        device=device,
        info=base.info,
    )
    try:
        # without a budget, what the policies leave free is planned as by default (NOTE: cheap recompute)
        plan, lean = plan_activations(problem, budget, free_price=CHEAP_PRICE)
    except ZeroFXError:
        lean = problem.solve(problem.price_bounds()[0])
        u = unconstrained.resident_bytes or 1
        raise ZeroFXError(
            f"{ctx.graph_id}: activation_budget={options.activation_budget!r} ({budget} B) is below what any "
            f"schedule can meet: the minimum feasible budget for this graph is {lean.resident_bytes} B "
            f"({lean.resident_bytes / u:.1%} of the unconstrained {unconstrained.resident_bytes} B"
            + (", with the checkpoint policies given" if recompute.keys() - base.must_recompute or save else "")
            + "). Values that must stay resident: "
            + ", ".join(
                f"{n.name} ({problem.why_kept(n) or 'cheapest to keep'})"
                for n in lean.saved
                if problem.save_bytes(n) > 0
            )[:600]
        ) from None

    plan = _agree_across_ranks(gm, problem, plan, ctx)
    _write_plan(gm, problem, plan, unconstrained, lean.resident_bytes, budget)
    _report(ctx, problem, plan, unconstrained, lean, budget, {**recompute, **save})
    return gm


def _write_plan(
    gm: fx.GraphModule,
    problem: PlanProblem,
    plan: ActivationPlan,
    unconstrained: ActivationPlan,
    min_feasible_bytes: int | None,
    budget: int | None,
) -> None:
    """Tag every forward node with the plan's decision (the partitioner's vocabulary) and keep
    the plan's numbers in ``gm.meta[ACTIVATION_PLAN]``."""
    recomputed = set(plan.recomputed)
    info = problem.info
    for n in gm.graph.nodes:
        if n in info.tangents_closure or n.op != "call_function" or n.meta.get(ROLE) == "gather":
            continue  # backward nodes, and gathers (always re-gathered) keep their tags
        if n in recomputed:
            n.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
        elif not isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
            n.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE
        n.meta.pop(OFFLOAD_TIER, None)
    for n, t in plan.offloaded.items():
        n.meta[OFFLOAD_TIER] = t
    gm.meta[ACTIVATION_PLAN] = {
        "unconstrained_bytes": unconstrained.resident_bytes,
        "resident_bytes": plan.resident_bytes,
        "offloaded_bytes": plan.offloaded_bytes,
        "recompute_flops": plan.recompute_flops,
        "min_feasible_bytes": min_feasible_bytes,
        "budget_bytes": budget,
        **plan.names(),
    }


# NOTE: cheap recompute
# With no budget and no checkpoint policy the forward still need not keep everything: a GELU's
# output, a norm's output, a SwiGLU's product are each one pass over memory to rebuild from
# values the backward keeps anyway (the matmul output the GELU's own backward reads, the norm's
# input and statistics), and each is as large as a layer's hidden state. torch's min-cut
# partitioner keeps them (it bans recomputing a value the backward must materialize, a rule
# made for Inductor, which fuses recompute into backward kernels). So the default plan is the
# min-cut at a fixed price of CHEAP_PRICE bytes per FLOP: a value is recomputed when that frees
# more than CHEAP_PRICE bytes per FLOP spent. Elementwise ops and norms (one FLOP per element
# in the cost model) free 2-4 bytes per FLOP (bf16 / fp32); matmuls and attention spend 2·K
# FLOPs per output element (K the contraction: head size at least), so they stay saved unless
# K < 4 / CHEAP_PRICE. Recompute runs the same ops on the same values: bit for bit the same
# gradients.
# The plan needs no agreement across ranks (NOTE: ranks agree) because it cannot change the
# collectives: a forward value that reads a gathered parameter the backward does not read
# anyway stays saved (a LayerNorm's recompute reads its weight and bias, which its backward
# reads too), so the backward re-gathers exactly the parameters it would without the plan, and
# ranks compiling at different times (dynamic="auto" with different shapes per rank) never
# wait for each other. ``disable_passes=("checkpoint",)`` gives torch's partitioner back.
CHEAP_PRICE = 0.5


def _gathered_reads(node: fx.Node) -> set[fx.Node]:
    """The gathered parameters ``node`` reads, through views."""
    out = set()
    for a in node.all_input_nodes:
        base = _alias_base(a)
        if base.meta.get(ROLE) in ("gather", "secondary_gather") or a.meta.get(ROLE) in ("gather", "secondary_gather"):
            out.add(base)
    return out


def _cheap_recompute(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The default plan: recompute what costs at most 1 / CHEAP_PRICE FLOPs per byte it frees
    (NOTE: cheap recompute)."""
    info = classify_nodes(gm, [], ctx.num_fwd_outputs)
    if not info.required_bw_nodes:
        return gm
    # the tags earlier passes wrote (regather: re-gather, or keep within keep_gathered_bytes)
    recompute, save = _policy_constraints(gm, info, ctx.options.memory, budgeted=False)
    read_by_backward = {g for n in gm.graph.nodes if n in info.tangents_closure for g in _gathered_reads(n)}
    for n in gm.graph.nodes:
        if info.is_required_fw(n) and n.op == "call_function" and n.meta.get(ROLE) != "gather" and n not in save:
            extra = _gathered_reads(n) - read_by_backward
            if extra:
                save[n] = f"reads {next(iter(extra)).name}, which the backward does not re-gather"
    device = ctx.cost.device_for(gm)
    problem = PlanProblem(gm, ctx.num_fwd_outputs, must_recompute=recompute, must_save=save, device=device, info=info)
    plan = problem.solve(CHEAP_PRICE)
    unconstrained = problem.solve(problem.price_bounds()[1])
    gathers = {n for n in gm.graph.nodes if n.meta.get(ROLE) == "gather"}
    needs = {g for n in plan.recomputed for g in _gathered_reads(n)} - read_by_backward - gathers
    if needs:  # cannot happen by construction; never let a plan change the collectives unagreed
        raise AssertionError(f"cheap recompute would re-gather {sorted(n.name for n in needs)}")
    _write_plan(gm, problem, plan, unconstrained, None, None)
    if plan.recomputed:
        ctx.report(
            f"cheap recompute: {len(plan.recomputed)} values rebuilt in the backward "
            f"({format_flops(plan.recompute_flops)}), saved activations {format_bytes(unconstrained.resident_bytes)}"
            f" -> {format_bytes(plan.resident_bytes)}"
        )
    return gm


def partition_by_plan(
    joint: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices: list[int] | None = None
) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """Forward and backward graphs that save exactly the checkpoint plan's values, built with
    torch's partitioner machinery; None when ``joint`` carries no plan (or torch lacks the
    helpers), in which case the caller uses ``min_cut_rematerialization_partition``."""
    plan = joint.meta.get(ACTIVATION_PLAN)
    if plan is None:
        return None
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
        from torch._functorch.compile_utils import raise_getitems
        from torch._functorch.partitioners import (
            _extract_fwd_bwd_modules,
            _is_assert_only_symbool,
            is_sym_node,
            reordering_to_mimic_autograd_engine,
            thread_graphsafe_rng_from_hops,
        )
    except ImportError:
        return None
    joint.graph.eliminate_dead_code()
    joint.recompile()
    info = classify_nodes(joint, static_lifetime_input_indices or [], num_fwd_outputs)
    by_name = {n.name: n for n in joint.graph.nodes}
    order = positions(joint.graph)
    names = (*plan["saved"], *plan["offloaded"], *plan["saved_other"])
    saved = sorted((by_name[name] for name in names), key=order.__getitem__)
    sym = [n for n in saved if is_sym_node(n) and not _is_assert_only_symbool(n)]
    opaque = [n for n in saved if is_opaque_node(n)]
    tensors = [n for n in saved if n not in sym and n not in opaque and not is_sym_node(n)]
    fw, bw = _extract_fwd_bwd_modules(
        joint,
        tensors,
        saved_sym_nodes=sym,
        saved_opaque_nodes=opaque,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=info.static_lifetime_input_nodes,
    )
    bw = reordering_to_mimic_autograd_engine(bw)
    fw, bw = raise_getitems(fw), raise_getitems(bw)
    return thread_graphsafe_rng_from_hops(fw, is_backward=False), thread_graphsafe_rng_from_hops(bw, is_backward=True)


PASS = Pass(
    "checkpoint",
    checkpoint_pass,
    kinds=("joint",),
    reads=(ROLE, RECOMPUTE, AC_REGION),
    writes=(RECOMPUTE, OFFLOAD_TIER, ACTIVATION_PLAN),
)
