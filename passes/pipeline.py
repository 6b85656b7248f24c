"""The pass pipeline: one ordered list of named passes and the runner that applies them.

Each pass module declares its contract (``PASS = Pass(name, fn, kinds, reads, writes)``,
passes/contract.py); this module orders the declarations, checks them, and runs them. The
runner, not the pass, recompiles, verifies (graph lint + zerofx invariants), stamps the nodes a
pass created with its name (``meta["zerofx_pass"]``), times, and records each pass for the debug
dump; passes can be disabled by name (``Options.disable_passes``).

AOTAutograd hands zerofx up to four kinds of graph per dynamo frame (``GRAPH_KINDS``: joint,
forward, backward, inference); each pass declares the kinds it runs on. Which passes there
are, in which order, and what each reads and writes is described once, in docs/architecture.md
("The pass pipeline"; a test keeps that table equal to the declarations).

ZeRO stages 1/2/3, the persistence threshold, hybrid meshes and no-sync accumulation are not
separate pipelines: they put different markers into the captured graphs (``zerofx.runtime.params``,
NOTE: markers per stage), and these same passes lower whatever markers they find.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

from torch import fx

from zerofx.errors import ZeroFXError
from zerofx.ir.meta import PASS as PROVENANCE
from zerofx.options import closest
from zerofx.passes import (
    bucket,
    checkpoint,
    elide,
    exchange,
    gather,
    offload,
    quantize,
    reduce,
    regather,
    schedule,
    secondary,
    transport,
)
from zerofx.passes.contract import GRAPH_KINDS, Pass, PassContext
from zerofx.passes.graph import copy_graph

__all__ = [
    "PASS_NAMES",
    "Pass",
    "PassContext",
    "default_pipeline",
    "check_contracts",
    "resolve_disabled",
    "run_pipeline",
    "verify_graph",
]

# The order passes run in. Joint passes come first (the partitioner then splits the joint graph),
# quantize then rewrites the collectives bucket merged and schedule placed, where they are, and
# transport then rewrites collectives every earlier pass placed, moved or merged; exchange
# narrows transport's gloo all-gathers over two ranks to one all-to-all each, and elide last
# drops the copies the bucketing and transport's local sums leave.
_MODULES = (
    regather,
    secondary,
    checkpoint,
    gather,
    reduce,
    bucket,
    schedule,
    offload,
    quantize,
    transport,
    exchange,
    elide,
)

# Old pass names still accepted in disable_passes, with a DeprecationWarning.
RENAMED = {"free": "regather"}


def check_contracts(passes: tuple[Pass, ...]) -> None:
    """Raise unless every meta key each pass reads is written by an earlier pass or by torch.

    "Earlier" is pipeline order over graph kinds: the partitioner copies node meta from the
    joint graph onto the forward and backward graphs, so a joint pass's writes are visible to
    every later pass."""
    written: set = set()
    names: set[str] = set()
    for p in passes:
        if p.name in names:
            raise ZeroFXError(f"pass {p.name!r} is declared twice in the pipeline")
        names.add(p.name)
        missing = [k.name for k in p.reads if not k.external and k not in written]
        if missing:
            raise ZeroFXError(
                f"pass {p.name!r} reads meta key(s) {missing} that no earlier pass writes; "
                "move it after their writer or declare the writer"
            )
        written.update(p.writes)


def default_pipeline() -> tuple[Pass, ...]:
    """Every pass, in order, from the pass modules' own declarations (contracts checked)."""
    passes = tuple(m.PASS for m in _MODULES)
    check_contracts(passes)
    return passes


PASS_NAMES = tuple(p.name for p in default_pipeline())


def resolve_disabled(names: tuple[str, ...]) -> tuple[str, ...]:
    """``Options.disable_passes`` checked against the pipeline: renamed passes map to their new
    name (with a DeprecationWarning), an unknown name raises naming the closest pass."""
    out = []
    for name in names:
        if name in RENAMED:
            warnings.warn(
                f"disable_passes: pass {name!r} is now called {RENAMED[name]!r}; the old name "
                "will stop working in a later release",
                DeprecationWarning,
                stacklevel=3,
            )
            name = RENAMED[name]
        if name not in PASS_NAMES:
            raise ZeroFXError(
                f"option disable_passes: unknown pass {name!r}{closest(name, PASS_NAMES)}; "
                f"the pipeline's passes are {list(PASS_NAMES)}"
            )
        out.append(name)
    return tuple(out)


Observer = Callable[[PassContext, str, fx.GraphModule | None, fx.GraphModule, float], None]


def run_pipeline(
    gm: fx.GraphModule,
    ctx: PassContext,
    *,
    passes: tuple[Pass, ...] | None = None,
    disabled: tuple[str, ...] = (),
    verify: bool = True,
    observer: Observer | None = None,
) -> fx.GraphModule:
    """Apply every enabled pass for ``ctx.kind`` in order.

    ``observer(ctx, pass_name, before, after, seconds)`` is called with a snapshot of the graph
    before each pass (and once with ``pass_name="input"``) so the dump can show what changed.
    """
    if ctx.kind not in GRAPH_KINDS:
        raise ValueError(f"unknown graph kind {ctx.kind!r}; kinds are {list(GRAPH_KINDS)}")
    passes = default_pipeline() if passes is None else passes
    if observer is not None:
        observer(ctx, "input", None, gm, 0.0)
    for p in passes:
        if ctx.kind not in p.kinds or p.name in disabled:
            continue
        before = copy_graph(gm) if observer is not None else None
        existing = {n.name for n in gm.graph.nodes}
        ctx.messages = []
        start = time.perf_counter()
        gm = p.fn(gm, ctx)
        for node in gm.graph.nodes:
            if node.name not in existing:
                node.meta.setdefault(PROVENANCE.name, p.name)
        if verify:
            verify_graph(gm, p.name, existing)
        if observer is not None:
            observer(ctx, p.name, before, gm, time.perf_counter() - start)
    # passes edit the graph and read nothing of its generated code: one recompile for all of them
    gm.recompile()
    return gm


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
