"""Each pass on small hand-made graphs (traced with fake tensors; no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import zerofx  # noqa: F401  (registers the marker ops)
from zerofx.errors import ZeroFXError
from zerofx.ir.collectives import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    ALL_TO_ALL,
    PAIR_GATHER_OUT,
    PAIR_REDUCE_SCATTER_OUT,
    PAIR_SUM,
    REDUCE_SCATTER,
    WAIT,
)
from zerofx.passes.gather import gather_pass
from zerofx.passes.pipeline import Pass, PassContext, run_pipeline
from zerofx.passes.reduce import reduce_pass
from zerofx.passes.regather import gather_chain, regather_pass

unshard = torch.ops.zerofx.unshard
reduce_grad = torch.ops.zerofx.reduce_grad
aten = torch.ops.aten


def trace(fn, *shapes) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def ctx(stage: str) -> PassContext:
    return PassContext("test", stage)


def ops(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def index(gm: fx.GraphModule, target) -> list[int]:
    return [i for i, t in enumerate(ops(gm)) if t is target]


def test_gather_lowers_marker_to_padded_all_gather_waited_before_first_use():
    # 10 rows over 4 ranks: padded shards of 3 rows, 12 gathered rows, sliced back to 10
    def fw(s, x):
        w = unshard(s, 4, "g", 10)
        return torch.relu(x) @ w.t()

    gm = gather_pass(trace(fw, (3, 5), (2, 5)), ctx("forward"))
    gm.recompile()
    targets = ops(gm)
    assert unshard.default not in targets
    assert targets.count(ALL_GATHER) == 1 and targets.count(WAIT) == 1
    (ag,) = index(gm, ALL_GATHER)
    (wait,) = index(gm, WAIT)
    (relu,) = index(gm, aten.relu.default)
    (mm,) = index(gm, aten.mm.default)
    assert ag < relu < wait < mm  # issued where the marker was, waited just before its first use
    assert aten.constant_pad_nd.default not in targets  # this shard has all 3 rows: no padding
    sl = next(n for n in gm.graph.nodes if n.target is aten.slice.Tensor)
    assert tuple(sl.meta["val"].shape) == (10, 5)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


def test_gather_pads_short_shard_and_skips_pad_and_slice_when_even():
    uneven = gather_pass(trace(lambda s: unshard(s, 4, "g", 10) * 2, (1, 5)), ctx("forward"))
    pad = next(n for n in uneven.graph.nodes if n.target is aten.constant_pad_nd.default)
    assert pad.args[1] == [0, 0, 0, 2] and tuple(pad.meta["val"].shape) == (3, 5)
    even = gather_pass(trace(lambda s: unshard(s, 2, "g", 6) * 2, (3, 5)), ctx("forward"))
    assert aten.constant_pad_nd.default not in ops(even) and aten.slice.Tensor not in ops(even)


def test_gather_merges_markers_of_the_same_shard():
    gm = trace(lambda s, x: x @ unshard(s, 2, "g", 6).t() + x @ unshard(s, 2, "g", 6).t(), (3, 5), (2, 5))
    gm = gather_pass(gm, ctx("forward"))
    assert ops(gm).count(ALL_GATHER) == 1


def test_gather_is_a_noop_without_markers():
    gm = trace(lambda x: torch.relu(x) + 1, (3,))
    before = gm.code
    assert gather_pass(gm, ctx("forward")).code == before


def test_reduce_lowers_marker_contiguous_padded_and_waits_before_next_issue():
    def bw(g1, g2):
        # a transposed (non-contiguous) gradient of a 10-row parameter over 4 ranks, then another
        a = reduce_grad(g1.t(), 4, "g", 1)
        b = reduce_grad(torch.relu(g2), 4, "g", 2)
        return a, b

    gm = reduce_pass(trace(bw, (5, 10), (8, 3)), ctx("backward"))
    gm.recompile()
    targets = ops(gm)
    assert reduce_grad.default not in targets and targets.count(REDUCE_SCATTER) == 2
    rs_nodes = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]
    assert all(n.args[1] == "avg" for n in rs_nodes)
    assert tuple(rs_nodes[0].args[0].meta["val"].shape) == (12, 5)  # padded to 4 * 3 rows
    assert rs_nodes[0].args[0].meta["val"].is_contiguous()
    rs1, rs2 = index(gm, REDUCE_SCATTER)
    wait1, wait2 = index(gm, WAIT)
    (relu,) = index(gm, aten.relu.default)
    assert rs1 < relu  # issued as soon as the first gradient exists
    assert wait1 < rs2 < wait2  # at most one reduce-scatter in flight
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert [tuple(o.meta["val"].shape) for o in out] == [(1, 5), (2, 3)]


def test_reduce_merges_tied_gradients_into_one_reduce_scatter():
    def bw(g1, g2):
        return reduce_grad(g1, 2, "g", 3).view(3, 4) + reduce_grad(g2 * 2, 2, "g", 3).view(3, 4)

    gm = reduce_pass(trace(bw, (6, 4), (6, 4)), ctx("backward"))
    assert ops(gm).count(REDUCE_SCATTER) == 1
    rs = next(n for n in gm.graph.nodes if n.target is REDUCE_SCATTER)
    assert rs.args[0].target is aten.add.Tensor  # the sum is reduced, not each term


def test_reduce_keeps_distinct_layouts_apart():
    def bw(g1, g2):
        return reduce_grad(g1, 2, "g", 3) + reduce_grad(g2, 2, "other", 3)

    assert ops(reduce_pass(trace(bw, (6, 4), (6, 4)), ctx("backward"))).count(REDUCE_SCATTER) == 2


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_transport_lowers_only_gloo_reduce_scatters_to_all_to_all_plus_local_sum(monkeypatch, backend):
    from zerofx.measure.instrument import graph_collectives
    from zerofx.passes import transport

    monkeypatch.setattr(transport, "backend_of", lambda group: backend)
    gm = reduce_pass(trace(lambda g: reduce_grad(g, 2, "g", 3) * 3, (6, 4)), ctx("backward"))
    before = graph_collectives(gm)
    gm = transport.transport_pass(gm, ctx("backward"))
    gm.recompile()
    if backend != "gloo":
        assert ops(gm).count(REDUCE_SCATTER) == 1 and transport.ALL_TO_ALL not in ops(gm)
        assert transport.RELEASE not in ops(gm)
        return
    assert REDUCE_SCATTER not in ops(gm) and ops(gm).count(transport.ALL_TO_ALL) == 1
    a2a = next(n for n in gm.graph.nodes if n.target is transport.ALL_TO_ALL)
    assert a2a.args[1] == a2a.args[2] == [3, 3] and a2a.args[3] == "g"
    # wait where the reduce-scatter's wait was, then: chunks per rank, added in rank order, averaged
    (wait,) = a2a.users
    (view,) = [u for u in wait.users if u.target is not transport.RELEASE]
    first, second = sorted(view.users, key=lambda n: n.args[2])
    assert (first.target, first.args[1:], second.target, second.args[1:]) == (
        aten.select.int,
        (0, 0),
        aten.select.int,
        (0, 1),
    )
    (total,) = second.users
    assert total.target is aten.add.Tensor and total.args == (first, second)
    (avg,) = total.users
    assert (wait.target, view.target, avg.target) == (WAIT, aten.view.default, aten.div.Tensor)
    assert tuple(view.meta["val"].shape) == (2, 3, 4) and tuple(avg.meta["val"].shape) == (3, 4)
    assert avg.args[1] == 2
    assert [c[:2] for c in graph_collectives(gm)] == [c[:2] for c in before] == [("reduce_scatter", 6 * 4 * 4 // 2)]
    # the graph frees the received chunks itself once the sum has read them; the sent input is
    # the graph's own input and the averaged shard is returned: both left alone
    nodes = list(gm.graph.nodes)
    assert [(n.args, nodes[nodes.index(n) - 1]) for n in nodes if n.target is transport.RELEASE] == [((wait, 0), total)]


def test_transport_frees_collective_buffers_the_graph_made_after_their_last_reader(monkeypatch):
    from zerofx.passes import transport

    monkeypatch.setattr(transport, "backend_of", lambda group: "gloo")

    def bw(g, s):
        w = unshard(s * 1, 2, "g", 6)  # the gather's input is a buffer this graph computed
        return reduce_grad(g * 2, 2, "g", 3), (w * 2).sum()

    gm = gather_pass(reduce_pass(trace(bw, (6, 4), (3, 4)), ctx("backward")), ctx("backward"))
    gm = transport.transport_pass(gm, ctx("backward"))
    gm.recompile()
    nodes = list(gm.graph.nodes)
    released = {n.args[0]: nodes[nodes.index(n) - 1] for n in nodes if n.target is transport.RELEASE}
    a2a = next(n for n in nodes if n.target is transport.ALL_TO_ALL)
    # on gloo the all-gather gathers into a buffer the graph allocates (NOTE: gloo all-gathers in flight)
    assert ALL_GATHER not in ops(gm)
    gathered = next(n for n in nodes if n.target is ALL_GATHER_OUT)
    buffer = gathered.kwargs["out"]
    assert buffer.target is aten.empty.memory_format and nodes.index(buffer) < nodes.index(gathered)
    assert buffer.meta["val"].shape == gathered.meta["val"].shape == (6, 4)
    (a2a_wait,) = a2a.users
    (gather_wait,) = gathered.users
    # sent buffers die right after their wait, received ones after their last reader
    assert released[a2a.args[0]] is a2a_wait
    assert released[a2a_wait].target is aten.add.Tensor  # c0 + c1, the last reader of the chunks
    assert released[gathered.args[0]] is gather_wait
    assert released[gather_wait].target is aten.mul.Tensor
    assert len(released) == 4


def test_transport_gathers_a_symbolic_shape_into_a_buffer_sized_in_the_graph(monkeypatch):
    """Dynamic shapes: an all-gather whose rows are a size symbol still takes gloo's out= form
    (NOTE: symbolic gathers); its buffer's sizes are read from the input when the graph runs."""
    from zerofx.passes import transport

    monkeypatch.setattr(transport, "backend_of", lambda group: "gloo")
    gm = make_fx(lambda x: WAIT(ALL_GATHER(x * 2, 2, "g")).sum(0), tracing_mode="symbolic")(torch.randn(5, 3))
    gm = transport.transport_pass(gm, ctx("forward"))
    gm.recompile()
    assert ALL_GATHER not in ops(gm)
    gathered = next(n for n in gm.graph.nodes if n.target is ALL_GATHER_OUT)
    buffer = gathered.kwargs["out"]
    assert buffer.target is aten.empty.memory_format
    rows, cols = buffer.args[0]
    assert rows.args[1] == 2 and rows.args[0].target is aten.sym_size.int and rows.args[0].args == (gathered.args[0], 0)
    assert cols.target is aten.sym_size.int and cols.args == (gathered.args[0], 1)
    assert buffer.meta["val"].shape == gathered.meta["val"].shape
    assert str(buffer.meta["val"].shape[0]) == str(2 * gathered.args[0].meta["val"].shape[0])


def test_exchange_turns_two_rank_gloo_gathers_into_pair_exchanges_and_elide_drops_copies(monkeypatch):
    """exchange: over two gloo ranks the out= all-gather becomes zerofx.all_gather_pair_out on
    the same input and buffer (its wait and the frees untouched), and the reduce-scatter's
    all-to-all and local sum become reduce_scatter_pair_out into a buffer of half the rows and
    an in-place pair_sum_, with the input freed after the sum and the received half never freed
    (it is the result); over four ranks all of it stays; elide: the four-rank local sum's
    average is divided in place."""
    from zerofx.passes import elide, exchange, transport

    monkeypatch.setattr(transport, "backend_of", lambda group: "gloo")
    monkeypatch.setattr(exchange, "backend_of", lambda group: "gloo")
    release = torch.ops.inductor.resize_storage_bytes_.default

    def bw(g, s):
        w = unshard(s * 1, 2, "g", 6)
        return reduce_grad(g * 2, 2, "g", 3), (w * 2).sum()

    gm = gather_pass(reduce_pass(trace(bw, (6, 4), (3, 4)), ctx("backward")), ctx("backward"))
    gm = transport.transport_pass(gm, ctx("backward"))
    gathered = next(n for n in gm.graph.nodes if n.target is ALL_GATHER_OUT)
    x, buf, users = gathered.args[0], gathered.kwargs["out"], set(gathered.users)
    a2a = next(n for n in gm.graph.nodes if n.target is ALL_TO_ALL)
    sent = a2a.args[0]
    inductor = PassContext("test", "backward", options=zerofx.Options(executor="inductor"))
    before = ops(gm)
    assert ops(elide.elide_pass(exchange.exchange_pass(gm, inductor), inductor)) == before  # Inductor's own
    gm = exchange.exchange_pass(gm, ctx("backward"))
    gm.graph.lint()
    assert ALL_GATHER_OUT not in ops(gm) and ALL_TO_ALL not in ops(gm)
    assert gathered.target is PAIR_GATHER_OUT and gathered.args == (x, "g") and gathered.kwargs["out"] is buf
    assert set(gathered.users) == users

    (pair,) = [n for n in gm.graph.nodes if n.target is PAIR_REDUCE_SCATTER_OUT]
    assert pair.args == (sent, "g") and tuple(pair.kwargs["out"].meta["val"].shape) == (3, 4)
    (landed,) = pair.users
    (summed,) = [n for n in gm.graph.nodes if n.target is PAIR_SUM]
    assert landed.target is WAIT and summed.args == (landed, sent, "g", 2)
    assert aten.div.Tensor not in ops(gm) and aten.select.int not in ops(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert summed in output.all_input_nodes  # the reduced gradient the backward returns
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    frees = [n for n in gm.graph.nodes if n.target is release]
    assert not any(f.args[0] in (pair, landed, summed, pair.kwargs["out"]) for f in frees)
    (free_sent,) = [f for f in frees if f.args[0] is sent]
    assert order[free_sent] > order[summed]

    four = trace(lambda s: unshard(s, 4, "g", 8) * 2, (2, 3))
    four = transport.transport_pass(gather_pass(four, ctx("forward")), ctx("forward"))
    four = exchange.exchange_pass(four, ctx("forward"))
    assert ALL_GATHER_OUT in ops(four) and PAIR_GATHER_OUT not in ops(four)

    four_bw = trace(lambda g: reduce_grad(g * 2, 4, "g", 2), (8, 4))
    four_bw = transport.transport_pass(reduce_pass(four_bw, ctx("backward")), ctx("backward"))
    four_bw = exchange.exchange_pass(four_bw, ctx("backward"))
    assert ALL_TO_ALL in ops(four_bw) and PAIR_REDUCE_SCATTER_OUT not in ops(four_bw)
    div = next(n for n in four_bw.graph.nodes if n.target is aten.div.Tensor)
    four_bw = elide.elide_pass(four_bw, ctx("backward"))
    assert div.target is aten.div_.Tensor and div.args[0].target is aten.add.Tensor


def test_elide_concatenates_a_bucket_into_its_gather_rows():
    from zerofx.passes import elide

    def fw(a, b):
        out = torch.empty(10)
        rows = out[0:5]
        rows.copy_(torch.cat([a.view(-1), b.view(-1)]))
        return out * 1

    gm = make_fx(fw, tracing_mode="fake")(torch.randn(3), torch.randn(2))
    gm = elide.elide_pass(gm, ctx("forward"))
    gm.recompile()
    assert aten.cat.default not in ops(gm) and aten.copy_.default not in ops(gm)
    (cat,) = [n for n in gm.graph.nodes if n.target is aten.cat.out]
    assert cat.kwargs["out"].target is aten.slice.Tensor
    a, b = torch.randn(3), torch.randn(2)
    assert torch.equal(gm(a, b)[:5], torch.cat([a, b]))


def test_free_tags_marker_and_its_views_but_not_computed_values():
    gm = trace(lambda s, x: x @ unshard(s, 2, "g", 6).t(), (3, 5), (2, 5))
    gm = regather_pass(gm, ctx("joint"))
    tagged = {n.target for n in gm.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert tagged == {unshard.default, aten.t.default}
    assert not any(n.target is aten.mm.default for n in gather_chain(gm.graph))


def test_runner_skips_disabled_passes_and_records_each_pass(monkeypatch):
    from zerofx.passes import exchange, transport

    monkeypatch.setattr(transport, "backend_of", lambda group: "gloo")  # group "g" is made up
    monkeypatch.setattr(exchange, "backend_of", lambda group: "gloo")
    seen = []
    gm = trace(lambda s: unshard(s, 2, "g", 6) * 2, (3, 5))
    gm = run_pipeline(
        gm, ctx("forward"), disabled=("gather",), observer=lambda c, name, before, after, secs: seen.append(name)
    )
    assert seen[0] == "input" and "gather" not in seen and unshard.default in ops(gm)
    seen.clear()
    gm = run_pipeline(gm, ctx("forward"), observer=lambda c, name, before, after, secs: seen.append(name))
    assert seen == ["input", "gather", "bucket", "schedule", "offload", "quantize", "transport", "exchange", "elide"]
    assert unshard.default not in ops(gm)
    assert PAIR_GATHER_OUT in ops(gm) and ALL_GATHER_OUT not in ops(gm)  # two ranks: an exchange


def test_runner_rejects_a_pass_that_drops_metadata():
    def careless_pass(gm, ctx):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        with gm.graph.inserting_after(node):
            gm.graph.call_function(aten.relu.default, (node,))
        return gm

    gm = trace(lambda x: x * 2, (3,))
    with pytest.raises(ZeroFXError, match="careless.*without meta"):
        run_pipeline(gm, ctx("forward"), passes=(Pass("careless", careless_pass, ("forward",)),))


def _two_layer_forward():
    def fw(s1, s2, x):
        w1 = unshard(s1, 2, "g", 64)
        h = torch.relu(x @ w1.t())
        h = torch.tanh(h) * 2 + 1
        w2 = unshard(s2, 2, "g", 64)
        return h @ w2.t()

    return gather_pass(trace(fw, (32, 64), (32, 64), (8, 64)), ctx("forward"))


@pytest.mark.parametrize("budget,expect_moved", [(0, False), (1 << 20, True)])
def test_schedule_prefetches_within_the_memory_budget(budget, expect_moved):
    from zerofx.options import Options
    from zerofx.passes.cost_model import estimate_memory
    from zerofx.passes.schedule import schedule_pass

    gm = _two_layer_forward()
    before = estimate_memory(gm).peak_bytes
    c = PassContext("test", "forward", Options(prefetch_bytes=budget))
    gm = schedule_pass(gm, c)
    gm.graph.lint()
    ag = index(gm, ALL_GATHER)
    first_mm = index(gm, aten.mm.default)[0]
    # gathering w2 before the first matmul holds both weights at once: only a budget allows it
    assert (ag[1] < first_mm) == expect_moved
    assert estimate_memory(gm).peak_bytes - before <= budget
    assert "estimated peak" in c.messages[0]


def test_cost_model_sizes_are_symbolic_in_dynamic_dims():
    import sympy

    from zerofx.passes.cost_model import node_bytes, node_flops

    gm = make_fx(lambda x, w: torch.relu(x @ w), tracing_mode="symbolic")(torch.randn(5, 3), torch.randn(3, 4))
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    expr = node_bytes(mm, symbolic=True)
    assert isinstance(expr, sympy.Expr) and expr.free_symbols
    assert node_bytes(mm) == 5 * 4 * 4  # concrete hint
    assert node_flops(mm) == 2 * 5 * 4 * 3


read_full = torch.ops.zerofx.read_full
sync_grad = torch.ops.zerofx.sync_grad
all_reduce_grad = torch.ops.zerofx.all_reduce_grad
local_grad = torch.ops.zerofx.local_grad
CONVERT = torch.ops.prims.convert_element_type.default
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


def test_gather_casts_the_shard_before_the_all_gather():
    """Mixed precision: the fp32 shard is cast to bf16 first, so the all-gather moves bf16."""
    gm = gather_pass(
        trace(lambda s, x: x.to(torch.bfloat16) @ unshard(s, 4, "g", 10, torch.bfloat16).t(), (3, 5), (2, 5)),
        ctx("forward"),
    )
    (convert,) = [
        n
        for n in gm.graph.nodes
        if n.target is CONVERT and n.args[0].op == "placeholder" and tuple(n.args[0].meta["val"].shape) == (3, 5)
    ]
    (ag,) = [n for n in gm.graph.nodes if n.target is ALL_GATHER]
    assert ag.args[0] is convert and ag.meta["val"].dtype == torch.bfloat16
    assert tuple(ag.meta["val"].shape) == (12, 5)


def test_gather_lowers_markers_of_whole_values_to_their_inputs():
    def fw(s, full, x, sink):
        a = read_full(s, full, 2, "g") * 2  # stages 1/2: the whole copy, no collective
        b = sync_grad(x, 2, "g", torch.bfloat16)  # a whole parameter, computed in bf16
        c = local_grad(full, sink) + 1  # no-sync: the value itself
        return a, b, c, read_full(s, full, 2, "g")  # returned directly: must not alias an input

    gm = gather_pass(trace(fw, (3, 5), (6, 5), (4,), (6, 5)), ctx("forward"))
    targets = ops(gm)
    assert not {read_full.default, sync_grad.default, local_grad.default} & set(targets)
    assert ALL_GATHER not in targets
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert mul.args[0] is placeholders[1]  # read_full -> full
    convert = next(n for n in gm.graph.nodes if n.target is CONVERT)
    assert convert.args == (placeholders[2], torch.bfloat16)  # sync_grad -> its cast
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert out[3].target is aten.clone.default  # the output keeps its own copy


def test_reduce_lowers_all_reduce_grad_and_casts_around_collectives():
    def bw(g1, g2):
        a = all_reduce_grad(g1, 2, "g", torch.float32, torch.float32)  # bf16 grad, fp32 reduce
        b = reduce_grad(g2, 2, "g", 3, torch.float32, torch.float32)
        return a, b

    gm = trace(bw, (4,), (6, 5))
    for n in gm.graph.nodes:  # make the gradients bf16, as a bf16 backward produces them
        if n.op == "placeholder":
            n.meta["val"] = n.meta["val"].to(torch.bfloat16)
    gm = reduce_pass(gm, ctx("backward"))
    (ar,) = [n for n in gm.graph.nodes if n.target is ALL_REDUCE]
    (rs,) = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]
    assert ar.args[1] == "avg" and ar.args[0].target is CONVERT and ar.meta["val"].dtype == torch.float32
    assert rs.args[0].target is CONVERT and rs.args[0].args[1] == torch.float32
    assert not {all_reduce_grad.default, reduce_grad.default} & set(ops(gm))
    assert ops(gm).count(WAIT) == 2


def test_reduce_merges_tied_all_reduce_grads_but_not_different_markers():
    same = reduce_pass(
        trace(lambda a, b: all_reduce_grad(a, 2, "g") + all_reduce_grad(b, 2, "g"), (4,), (4,)), ctx("backward")
    )
    assert ops(same).count(ALL_REDUCE) == 1
    mixed = reduce_pass(
        trace(lambda a, b: all_reduce_grad(a, 2, "g") + reduce_grad(b, 1, "g", 4), (4,), (4,)), ctx("backward")
    )
    assert ops(mixed).count(ALL_REDUCE) == 1 and ops(mixed).count(REDUCE_SCATTER) == 1


def test_free_tags_every_forward_marker():
    gm = trace(
        lambda s, full, x, sink: x @ read_full(s, full, 2, "g").t() + local_grad(sync_grad(x @ full.t(), 2, "g"), sink),
        (3, 5),
        (6, 5),
        (2, 5),
        (2, 6),
    )
    gm = regather_pass(gm, ctx("joint"))
    tagged = {n.target for n in gm.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert {read_full.default, sync_grad.default, local_grad.default, aten.t.default} <= tagged
    assert aten.mm.default not in tagged


def _four_layer_forward(blocks: tuple[str, ...]):
    """Four 16 KiB gathers; the i-th weight is read by module ``blocks[i]`` (dynamo's stack meta)."""

    def fw(s1, s2, s3, s4, x):
        for s in (s1, s2, s3, s4):
            x = torch.tanh(x @ unshard(s, 2, "g", 64).t())
        return x

    gm = gather_pass(trace(fw, *[(32, 64)] * 4, (8, 64)), ctx("forward"))
    for node, block in zip([n for n in gm.graph.nodes if n.op == "placeholder"], blocks):
        node.meta["nn_module_stack"] = {"m": (f"L['fn'].__self__.{block}.fc", torch.nn.Linear)}
    return gm


@pytest.mark.parametrize(
    "setting,host_cap,expect",
    [
        ("auto", None, [2, 2]),  # one bucket per block, each past the 4 KB size cap
        ("auto", 16 * 20_000, []),  # host_memory_cap/16 = 20 KB: a 32 KiB block bucket would not fit
        (4_000, None, []),  # an explicit cap is a cap: no block may exceed it
        (40_000, None, [2, 2]),  # 40 KB holds two 16 KiB gathers, whatever their blocks
    ],
)
def test_bucket_merges_one_blocks_collectives_past_the_size_cap(setting, host_cap, expect):
    from zerofx.options import Options
    from zerofx.passes.bucket import choose_buckets, resolve_bucket_bytes
    from zerofx.passes.cost_model import CommModel, CostModel

    gm = _four_layer_forward(("blocks.0", "blocks.0", "blocks.1", "blocks.1"))
    cost = CostModel(comm=CommModel(latency_s=1e-6, seconds_per_byte=1e-9))  # saturates at 4 KB
    c = PassContext("test", "forward", Options(bucket_bytes=setting, host_memory_cap=host_cap), cost=cost)
    cap, by_block, ceiling = resolve_bucket_bytes(c)
    buckets = choose_buckets(gm, ALL_GATHER, cap, by_block=by_block, ceiling=ceiling)
    assert [len(b) for b in buckets] == expect
    # with every weight in its own block nothing may exceed the size cap; explicit caps ignore blocks
    spread = _four_layer_forward(("blocks.0", "blocks.1", "blocks.2", "blocks.3"))
    merged = choose_buckets(spread, ALL_GATHER, cap, by_block=by_block, ceiling=ceiling)
    assert [len(b) for b in merged] == ([] if setting == "auto" else expect)
    # blocks smaller than the cap are taken whole until the bucket has reached the cap
    assert [len(b) for b in choose_buckets(spread, ALL_GATHER, 40_000, by_block=True)] == [3]
    assert [len(b) for b in choose_buckets(gm, ALL_GATHER, 40_000, by_block=True)] == [4]
    assert [len(b) for b in choose_buckets(gm, ALL_GATHER, 40_000, by_block=True, ceiling=40_000)] == [2, 2]


@pytest.mark.parametrize("quantized", [False, True])
def test_bucket_leaves_apart_what_zeropp_could_not_cut_by_member(monkeypatch, quantized):
    """ZeRO++ quantizes a bucket in blocks of each member's own (BUCKET_SEGMENTS); where the
    members' sizes are symbolic there are no segments, and a quantized bucket would cut blocks
    across members (a LayerNorm weight scaled by a matmul's values): such gathers stay apart."""
    import zerofx.passes.bucket as bucket
    from zerofx.options import Options

    merged = []
    monkeypatch.setattr(bucket, "_segments", lambda members, world: None)
    monkeypatch.setattr(bucket, "_merge_gathers", lambda gm, members, *a, **k: merged.append(len(members)) or [])
    gm = _four_layer_forward(("blocks.0", "blocks.0", "blocks.1", "blocks.1"))
    options = Options(bucket_bytes=40_000, **({"quantize_weights": "int8"} if quantized else {}))
    bucket.bucket_pass(gm, PassContext("test", "forward", options))
    assert merged == ([] if quantized else [2, 2])


def test_module_block_reads_forward_and_backward_module_stacks():
    from zerofx.passes.modules import block_of, module_block, module_path

    assert module_path("L['fn'].__self__.blocks._modules['2'].attn") == "blocks.2.attn"
    assert [block_of(p) for p in ("blocks.2.attn.qkv", "layers.11", "wte")] == ["blocks.2", "layers.11", "wte"]
    gm = _four_layer_forward(("blocks.0", "blocks.0", "blocks.1", "blocks.1"))
    gathers = [n for n in gm.graph.nodes if n.target is ALL_GATHER]
    assert [module_block(g) for g in gathers] == ["blocks.0", "blocks.0", "blocks.1", "blocks.1"]
    node = gathers[0].args[0]
    del [n for n in gm.graph.nodes if n.op == "placeholder"][0].meta["nn_module_stack"]
    assert module_block(node) is None
    node.meta["fwd_nn_module_stack"] = {"m": ("L['fn'].__self__.head", torch.nn.Linear)}  # AOT's backward copy
    assert module_block(node) == "head"


def _plan_small_gpt(world, n_layer: int, **options) -> None:
    """``zerofx.plan`` of a small GPT's training step (the real pipeline on fake tensors)."""
    import zerofx
    from zerofx.models import GPT, GPTConfig

    zerofx.plan(
        lambda: GPT(GPTConfig(vocab_size=128, seq_len=16, n_layer=n_layer, n_head=2, d_model=32)),
        world,
        batch=2,
        seq=16,
        device="cpu",
        backend="gloo",
        exact=True,
        **options,
    )


def _canonical_graphs(dump_dir) -> dict[str, list[str]]:
    """Every dumped graph after the bucket pass and the final one, per (graph kind, pass), as code
    with each assigned name replaced by its definition index (surgeries may number nodes apart)."""
    import re

    graphs = {}
    for path in sorted(dump_dir.glob("rank0/frame*_*/*.py")):
        kind = path.parent.name.split("_", 1)[1]
        names: dict[str, str] = {}
        lines = []
        for line in path.read_text().splitlines():
            if not line.strip() or line.strip().startswith("#"):
                continue
            m = re.match(r"\s+(\w+)(:[^=]*)? = ", line)
            if m:
                names[m.group(1)] = f"v{len(names)}"
            lines.append(re.sub(r"(?<![.\w])[A-Za-z_]\w*\b", lambda w: names.get(w.group(0), w.group(0)), line))
        graphs[f"{kind}/{path.stem.split('_', 1)[1]}"] = lines
    return graphs


@pytest.mark.parametrize(
    "world,options",
    [
        (2, {}),
        (4, {}),
        (2, {"param_dtype": torch.bfloat16}),  # casts before the gathers: torch folds them into its copy-in
        (4, {"quantize_weights": "int8", "quantize_grads": "int8"}),
        ((2, 2), {"secondary_shard": True}),  # hpZ: inner re-gathers on the 2-D mesh's inner group
    ],
)
def test_bucket_surgery_writes_the_graphs_torchs_surgery_writes(tmp_path, monkeypatch, world, options):
    """passes/bucket.py NOTE: bucket surgery. The same training step planned twice, once with
    the direct surgery and once with torch's for every bucket: every graph the pipeline dumps
    after bucketing is the same, node for node; without casts to fold the direct surgery does
    every bucket itself."""
    import zerofx.passes.bucket as bucket

    torch_calls = []
    for name in ("merge_all_gather_bucket", "merge_reduce_scatter_bucket"):
        original = getattr(bucket, name)
        monkeypatch.setattr(
            bucket, name, lambda *a, _f=original, _n=name, **k: (torch_calls.append(_n), _f(*a, **k))[1]
        )

    def planned(dump_dir):
        _plan_small_gpt(world, 3, dump_dir=str(dump_dir), **options)
        return _canonical_graphs(dump_dir)

    direct = planned(tmp_path / "direct")
    direct_torch_calls = list(torch_calls)
    monkeypatch.setattr(bucket, "_merge_gathers", lambda *a, **k: None)
    monkeypatch.setattr(bucket, "_merge_reduce_scatters", lambda *a, **k: None)
    torchs = planned(tmp_path / "torch")
    after_bucket = [k for k in torchs if k.split("/")[1] not in ("input", "gather", "reduce")]
    assert after_bucket and len(torch_calls) > len(direct_torch_calls)
    assert sorted(direct) == sorted(torchs)
    for key in after_bucket:
        assert direct[key] == torchs[key], key
    if "param_dtype" not in options:
        assert direct_torch_calls == []


def _layout(val, inputs) -> tuple:
    """What a fake value says: class, sizes, strides, offset, dtype, device, grad flag, and
    which input's storage it shares (views), or none."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(val, (tuple, list)):
        return tuple(_layout(v, inputs) for v in val)
    storage = val.untyped_storage()
    shared = [k for k, t in enumerate(inputs) if t.untyped_storage()._cdata == storage._cdata]
    return (
        type(val) is FakeTensor,
        tuple(val.shape),
        val.stride(),
        val.storage_offset(),
        val.dtype,
        val.fake_device,
        val.requires_grad,
        tuple(shared),
    )


@pytest.mark.parametrize(
    "world,options",
    [(2, {}), (4, {"quantize_weights": "int8", "quantize_grads": "int8"}), (2, {"param_dtype": torch.bfloat16})],
)
def test_insert_call_meta_kernel_values_match_the_fake_modes(monkeypatch, world, options):
    """passes/graph.py NOTE: fake values of inserts. Every value insert_call takes from an op's
    meta kernel while a GPT's step is planned is the value the fake mode computes for the same
    call: same class, layout, device, grad flag and aliasing."""
    from torch.utils._pytree import tree_flatten

    import zerofx.passes.graph as graph

    direct = graph._meta_kernel_value
    seen = {}

    def both(mode, target, args, kwargs):
        val = direct(mode, target, args, kwargs)
        if val is not None:
            inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            with mode:
                expected = target(*args, **kwargs)
            assert _layout(val, inputs) == _layout(expected, inputs), target
            seen[target] = seen.get(target, 0) + 1
        return val

    monkeypatch.setattr(graph, "_meta_kernel_value", both)
    _plan_small_gpt(world, 2, **options)
    aten = torch.ops.aten
    expected = {aten.view.default, WAIT, ALL_GATHER, REDUCE_SCATTER, aten.cat.default, aten.split_with_sizes.default}
    if "param_dtype" not in options:  # else torch's surgery builds the gather buckets (casts to fold)
        expected |= {aten.clone.default, aten._unsafe_view.default}
    assert expected <= seen.keys(), expected - seen.keys()


def pair_reduce_scatter_against_all_to_all(rank: int, world: int) -> dict:
    """On two gloo ranks: transport's lowering (all-to-all of the whole input, rank-ordered sum)
    and exchange's (reduce_scatter_pair_out, pair_sum_) of the same inputs, fp32 and bf16, sum
    and avg; the pair form's result must be those bits, in the buffer it was given."""
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    same, in_place = [], []
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(6, 5, generator=torch.Generator().manual_seed(rank)) * 1000).to(dtype)
        for divisor in (1, 2):
            chunks = WAIT(ALL_TO_ALL(x, [3, 3], [3, 3], group)).view(2, 3, 5)
            expected = chunks[0] + chunks[1]
            expected = expected / divisor if divisor != 1 else expected
            buf = torch.empty(3, 5, dtype=dtype)
            got = PAIR_SUM(WAIT(PAIR_REDUCE_SCATTER_OUT(x, group, out=buf)), x, group, divisor)
            same.append(torch.equal(got, expected))
            in_place.append(got.data_ptr() == buf.data_ptr())
            everyone = x.float().clone()
            dist.all_reduce(everyone)
            assert torch.allclose(got.float() * divisor, everyone[3 * rank : 3 * rank + 3], rtol=1e-2)
    try:
        PAIR_REDUCE_SCATTER_OUT(torch.randn(5, 2), group, out=torch.empty(2, 2))
        refused = False
    except ValueError as e:
        refused = "even number of rows" in str(e)
    return {"same": same, "in_place": in_place, "refused": refused}


def test_the_pair_reduce_scatter_gives_the_all_to_all_lowerings_bits():
    from tests.multirank import run_ranks

    for rank, r in enumerate(run_ranks(pair_reduce_scatter_against_all_to_all, 2, timeout=120)):
        assert r == {"same": [True] * 4, "in_place": [True] * 4, "refused": True}, (rank, r)
