"""exchange: an all-gather over two gloo ranks becomes one all-to-all into the graph's buffer.

After transport, every gloo all-gather is ``all_gather_into_tensor_out(x, N, group, out=buf)``.
ProcessGroupGloo runs that op by gathering into a flat buffer of its own and copying each
rank's chunk out of it into ``buf``: one more ``buf``-sized allocation and two ``buf``-sized
copies per all-gather, on gloo's worker thread, which on a machine whose cores the ranks already
fill takes them from compute (NOTE: pair exchange, zerofx/ir/collectives.py). Over two ranks
an all-gather is an exchange, so where ``N == 2`` this pass writes

    ag = _c10d_functional.all_gather_into_tensor_out(x, 2, group, out=buf)
  as
    ag = zerofx.all_gather_pair_out(x, group, out=buf)

an all-to-all that sends ``x`` (already this rank's rows of ``buf`` when a bucket gathered it)
and receives the peer's rows straight into theirs. The result, its wait, the bytes on the wire
and the buffer frees transport placed are unchanged; the cost model's gloo workspace
(NOTE: collective workspace) is gone with it. Groups of more than two ranks keep the
all-gather: an all-to-all would need this rank's rows once per peer in its input.
``disable_passes=("exchange",)`` turns it off (bit for bit the same values). Graphs for
``executor="inductor"`` keep the all-gather, which Inductor lowers as a collective of its own.
"""

from __future__ import annotations

from torch import fx

from zerofx.ir.collectives import ALL_GATHER_OUT, PAIR_GATHER_OUT, backend_of
from zerofx.passes.contract import Pass, PassContext


def exchange_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Gloo all-gathers over two ranks -> exchanges into the same buffer."""
    if ctx.options.codegen.executor == "inductor":
        return gm
    backends: dict[str, str] = {}
    rewritten = 0
    for ag in [n for n in gm.graph.nodes if n.target is ALL_GATHER_OUT]:
        x, world, group = ag.args[:3]
        if world != 2:
            continue
        if group not in backends:
            backends[group] = backend_of(group)
        if backends[group] != "gloo":
            continue
        ag.target = PAIR_GATHER_OUT
        ag.args = (x, group)
        rewritten += 1
    if rewritten:
        ctx.report(f"{rewritten} all-gathers over two gloo ranks exchange rows with one all-to-all")
    return gm


PASS = Pass("exchange", exchange_pass, kinds=("forward", "backward", "inference"), reads=(), writes=())
