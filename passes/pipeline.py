"""The pass pipeline: one ordered list of named passes and the runner that applies them.

Contract of a pass: ``fn(gm, ctx) -> gm``. It says in its docstring why it exists, does nothing
when nothing in the graph matches, and keeps ``node.meta["val"]`` valid for every node it adds.
The runner, not the pass, recompiles, verifies (graph lint + zerofx invariants), times, and
records each pass for the debug dump; passes can be disabled by name (``Options.disable_passes``).

Where passes run. AOTAutograd hands zerofx three kinds of graph per dynamo frame:

    joint      forward+backward before partitioning: decide what the backward recomputes
    forward    the forward half (training)           lower markers into collectives
    backward   the backward half                     lower markers into collectives
    inference  forward without autograd              lower markers into collectives

Each pass declares the (graph) stages it applies to. The pipeline, in order:

    free        (joint)                       forward markers are recomputed in backward, never saved
                                              (except gathers selective unsharding keeps)
    checkpoint  (joint)                       save / recompute / offload each value the backward reads,
                                              under the activation budget (tags for the partitioner)
    gather      (forward, backward, inference) unshard -> [cast] all_gather + wait before first use;
                                              read_full / sync_grad / local_grad -> their input
    reduce      (backward)                    reduce_grad -> reduce_scatter(avg) into the shard;
                                              all_reduce_grad -> all_reduce(avg)
    bucket      (forward, backward, inference) neighbouring collectives merged up to a byte cap
    schedule    (forward, backward, inference) prefetch all-gathers, defer reduce-scatter waits
    offload     (forward, backward)           park chosen saved values in host memory / on disk and
                                              reload them ahead of use; page offloaded params out
    transport   (forward, backward, inference) how each collective moves on its group's backend:
                                              gloo reduce-scatter -> all-to-all + local sum

ZeRO stages 1/2/3, the persistence threshold, hybrid meshes and no-sync accumulation are not
separate pipelines: they put different markers into the captured graphs (``zerofx.params``,
NOTE: markers per stage), and these same passes lower whatever markers they find.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from torch import fx

from zerofx.errors import ZeroFXError

STAGES = ("joint", "forward", "backward", "inference")


@dataclass
class PassContext:
    """What a pass may know about the graph it rewrites."""

    graph_id: str
    stage: str
    options: object = None
    num_fwd_outputs: int | None = None  # joint stage: how many joint outputs belong to the forward
    messages: list[str] = field(default_factory=list)

    def report(self, message: str) -> None:
        """Say what the pass decided; the dump shows it under the pass (e.g. tags set)."""
        self.messages.append(message)


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    stages: tuple[str, ...]

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""


def _build() -> tuple[Pass, ...]:
    from zerofx.passes.bucket import bucket_pass
    from zerofx.passes.checkpoint import checkpoint_pass
    from zerofx.passes.free import free_pass
    from zerofx.passes.gather import gather_pass
    from zerofx.passes.offload import offload_pass
    from zerofx.passes.reduce import reduce_pass
    from zerofx.passes.schedule import schedule_pass
    from zerofx.passes.transport import transport_pass

    return (
        Pass("free", free_pass, ("joint",)),
        Pass("checkpoint", checkpoint_pass, ("joint",)),
        Pass("gather", gather_pass, ("forward", "backward", "inference")),
        Pass("reduce", reduce_pass, ("backward",)),
        Pass("bucket", bucket_pass, ("forward", "backward", "inference")),
        Pass("schedule", schedule_pass, ("forward", "backward", "inference")),
        Pass("offload", offload_pass, ("forward", "backward", "inference")),
        Pass("transport", transport_pass, ("forward", "backward", "inference")),
    )


PASS_NAMES = ("free", "checkpoint", "gather", "reduce", "bucket", "schedule", "offload", "transport")


def default_pipeline() -> tuple[Pass, ...]:
    passes = _build()
    assert tuple(p.name for p in passes) == PASS_NAMES
    return passes


Observer = Callable[[PassContext, str, fx.GraphModule | None, fx.GraphModule, float], None]


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, *, passes: tuple[Pass, ...] | None = None,
                 disabled: tuple[str, ...] = (), verify: bool = True,
                 observer: Observer | None = None) -> fx.GraphModule:
    """Apply every enabled pass for ``ctx.stage`` in order.

    ``observer(ctx, pass_name, before, after, seconds)`` is called with a snapshot of the graph
    before each pass (and once with ``pass_name="input"``) so the dump can show what changed.
    """
    if ctx.stage not in STAGES:
        raise ValueError(f"unknown stage {ctx.stage!r}")
    passes = default_pipeline() if passes is None else passes
    if observer is not None:
        observer(ctx, "input", None, gm, 0.0)
    for p in passes:
        if ctx.stage not in p.stages or p.name in disabled:
            continue
        before = _snapshot(gm) if observer is not None else None
        existing = {n.name for n in gm.graph.nodes} if verify else set()
        ctx.messages = []
        start = time.perf_counter()
        gm = p.fn(gm, ctx)
        gm.recompile()
        if verify:
            verify_graph(gm, p.name, existing)
        if observer is not None:
            observer(ctx, p.name, before, gm, time.perf_counter() - start)
    return gm


def _snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy of ``gm`` (nodes and meta), cheap enough to take before every pass."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def verify_graph(gm: fx.GraphModule, after: str, existing: set[str] = frozenset()) -> None:
    """Lint the graph and check that every value the pass added has fake-tensor metadata.

    Nodes named in ``existing`` were there before the pass: some of torch's own rewrites (e.g.
    the partitioner's RNG-state wrappers) come without metadata, and that is not the pass's doing."""
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises bare RuntimeErrors; name the culprit pass
        raise ZeroFXError(f"graph invalid after pass {after!r}: {e}") from e
    for node in gm.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta and node.name not in existing:
            raise ZeroFXError(f"pass {after!r} left node {node.name} ({node.target}) without meta['val']")
