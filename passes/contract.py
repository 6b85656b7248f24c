"""What a pass is: its contract (``Pass``) and what it may know about the graph it rewrites
(``PassContext``).

Every pass module ends with one declaration::

    PASS = Pass("bucket", bucket_pass, kinds=("forward", "backward", "inference"),
                reads=(ROLE,), writes=())

``kinds`` are the graph kinds it runs on (``GRAPH_KINDS``); ``reads`` and ``writes`` are the
``zerofx.ir.meta`` keys it reads from and writes to nodes (or ``gm.meta``). The pipeline
(passes/pipeline.py) is the ordered list of these declarations; it checks when it is built that
every key a pass reads is written by an earlier pass (or by torch: ``MetaKey.external``), and
the runner stamps every node a pass creates with the pass's name (``meta["zerofx_pass"]``).

A pass is ``fn(gm, ctx) -> gm``: it says in its docstring why it exists, does nothing when
nothing in the graph matches, and keeps ``node.meta["val"]`` valid for every node it adds. It
reads configuration from ``ctx.options`` (typed ``zerofx.Options``: ``ctx.options.comm``, ...)
and prices decisions with ``ctx.cost`` (the one cost model), never from globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import fx

from zerofx.ir.meta import MetaKey
from zerofx.options import Options
from zerofx.passes.cost_model import CostModel

__all__ = ["GRAPH_KINDS", "Pass", "PassContext"]

# What AOTAutograd hands zerofx per dynamo frame, in the order zerofx sees them.
GRAPH_KINDS = ("joint", "forward", "backward", "inference")


@dataclass
class PassContext:
    """What a pass may know about the graph it rewrites."""

    graph_id: str
    kind: str  # one of GRAPH_KINDS
    options: Options = field(default_factory=Options)
    num_fwd_outputs: int | None = None  # joint graphs: how many joint outputs belong to the forward
    cost: CostModel = field(default_factory=CostModel)
    messages: list[str] = field(default_factory=list)
    # called right before a collective a pass issues at compile time (the checkpoint plan's
    # agreement): the backend's lockstep check, so that a rank compiling alone (its peers run
    # their graphs) raises on every rank instead of meeting their collectives (zerofx/backend.py)
    before_agreement: Callable[[], None] | None = None

    def report(self, message: str) -> None:
        """Say what the pass decided; the dump shows it under the pass (e.g. tags set)."""
        self.messages.append(message)


@dataclass(frozen=True)
class Pass:
    """One pass and its contract (see the module docstring)."""

    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    kinds: tuple[str, ...]
    reads: tuple[MetaKey, ...] = ()
    writes: tuple[MetaKey, ...] = ()

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in GRAPH_KINDS]
        if bad:
            raise ValueError(f"pass {self.name!r}: unknown graph kind(s) {bad}; kinds are {list(GRAPH_KINDS)}")

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""
