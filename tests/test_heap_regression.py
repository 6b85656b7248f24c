"""Issue 13's heap corruption: its cause, fixed, and a suspect ruled out.

The cause (zerofx/ir/collectives.py, NOTE: gloo all-gathers in flight): torch's out-of-place
all-gather runs ProcessGroupGloo's coalesced all-gather work, and two of those in flight corrupt
the heap (tests/gloo_repro.py shows it with torch alone). zerofx now issues the ``out=`` form on
gloo, in its graphs (passes/transport.py) and in its eager code (``ir.collectives.all_gather``):

* no out-of-place all-gather is dispatched on gloo in a training step, whatever runs it (graphs,
  the stage-1/2 eager refresh, the markers' eager bodies): torch's profiler sees every op;
* a compiled model whose forward keeps twelve all-gathers in flight trains a thousand steps;
  with the rewrite switched off (``broken=True``) the same run aborts in glibc (docs/measurements.md,
  transport, says how often).

The suspect ruled out, checked at run time: a gloo buffer freed under its collective.

The transport pass (passes/transport.py) frees the buffers of gloo collectives itself, with
``inductor::resize_storage_bytes_(t, 0)`` after their last reader. If such a free ever ran
before the collective's ``wait_tensor``, gloo's worker thread would read or write freed heap
memory: the kind of corruption glibc reported (``malloc(): unaligned tcache chunk detected``).
``LifetimeCheck`` watches every op the compiled graphs dispatch and records each free of a
storage that an issued, not yet waited collective reads or writes. Two tests:

* the GPT of the memory tests, with the policy the crash was seen under (state on disk, a 64 KiB
  host cap: small buckets, so many collectives and frees), trains with no such free;
* the same check finds the bug when the pass is broken on purpose (each free moved to right
  after its collective is issued), so a clean result means something.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.multirank import run_ranks

_RELEASE = torch.ops.inductor.resize_storage_bytes_.default


class LifetimeCheck(TorchDispatchMode):
    """Records frees (``resize_storage_bytes_(t, 0)``) of storages an un-waited collective uses,
    and skips them, so that a run with such a bug reports it instead of corrupting its heap."""

    def __init__(self, log: dict):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = self.log["pending"]
        if func is _RELEASE and args[1] == 0:
            self.log["frees"] += 1
            key = args[0].untyped_storage()._cdata
            if key in pending:  # recorded and skipped: gloo would touch freed memory
                self.log["violations"].append(f"{tuple(args[0].shape)} freed while {pending[key][0]} is un-waited")
                return None
        out = func(*args, **kwargs)
        # the functional collectives, and the exchange pass's pair all-gather and reduce-scatter
        # (zerofx/ir/collectives.py)
        namespace = getattr(func, "namespace", None)
        if namespace == "_c10d_functional" or (
            namespace == "zerofx" and func._opname in ("all_gather_pair_out", "reduce_scatter_pair_out")
        ):
            if func._opname == "wait_tensor":
                done = args[0].untyped_storage()._cdata
                for key in [k for k, (_, o) in pending.items() if o == done]:
                    del pending[key]
            elif isinstance(out, torch.Tensor):
                self.log["collectives"] += 1
                owner = out.untyped_storage()._cdata
                for t in [*args, *kwargs.values(), out]:
                    if isinstance(t, torch.Tensor):
                        pending[t.untyped_storage()._cdata] = (func._opname, owner)
        return out


def _install(log: dict) -> None:
    """Run every compiled graph under the check (through the executor's stress hook)."""
    from zerofx import stress

    inner = stress.wrap_graph

    def wrap(fn):
        fn = inner(fn)

        def run(args):
            with LifetimeCheck(log):
                return fn(args)

        run._boxed_call = True
        return run

    stress.wrap_graph = wrap


def _free_right_after_issue() -> None:
    """Break the transport pass on purpose: every free moves to just after its collective."""
    from zerofx.ir.collectives import COLLECTIVE_OPS
    from zerofx.passes import transport

    release = transport._release_buffers

    def broken(gm, ctx, backends):
        release(gm, ctx, backends)
        issued = {}
        for node in gm.graph.nodes:
            if node.target in COLLECTIVE_OPS:
                for arg in node.all_input_nodes:
                    issued.setdefault(arg, node)
                issued.setdefault(node, node)
        waits = {n: n.args[0] for n in gm.graph.nodes if n.target is transport.WAIT}
        for node in [n for n in gm.graph.nodes if n.target is _RELEASE]:
            buf = node.args[0]  # the pass frees a collective's input or its wait (the output)
            coll = issued.get(waits.get(buf, buf))
            if coll is not None:
                node.args = (coll if buf in waits else buf, 0)
                coll.append(node)
        gm.graph.lint()

    transport._release_buffers = broken


def train_checked(rank: int, world: int, folder: str, policy: str, broken: bool) -> dict:
    from tests import memory_scenarios as ms

    log = {"pending": {}, "violations": [], "frees": 0, "collectives": 0}
    _install(log)
    if broken:
        _free_right_after_issue()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    initial, _, _ = ms._reference("gpt", world)
    error = None
    try:
        ms._train_policy("gpt", policy, rank, world, mesh, initial, os.path.join(folder, f"rank{rank}"))
    except Exception as e:  # a broken pass may also make the step fail; the check is what we read
        error = repr(e)[:300]
    return {"violations": log["violations"], "frees": log["frees"], "collectives": log["collectives"], "error": error}


def test_no_gloo_buffer_is_freed_before_its_wait(tmp_path):
    for rank, r in enumerate(
        run_ranks(train_checked, 2, str(tmp_path), "budget_100+optimizer_disk", False, timeout=600)
    ):
        assert r["error"] is None, (rank, r["error"])
        assert r["frees"] > 100 and r["collectives"] > 100, (rank, r)
        assert r["violations"] == [], (rank, r["violations"][:5])


def test_the_check_finds_a_free_before_the_wait(tmp_path):
    results = run_ranks(train_checked, 2, str(tmp_path), "budget_100+optimizer_disk", True, timeout=600)
    assert all(r["violations"] for r in results), [r["frees"] for r in results]


# -- the cause: out-of-place all-gathers on gloo ---------------------------------------------------

_OUT_OF_PLACE = "_c10d_functional::all_gather_into_tensor"
_OUT_FORM = "_c10d_functional::all_gather_into_tensor_out"
_PAIR = "zerofx::all_gather_pair_out"  # the exchange pass's form over two gloo ranks (NOTE: pair exchange)


def gathers_dispatched(rank: int, world: int) -> dict:
    """Every all-gather op torch's profiler saw in the last training step of each variant: ZeRO-3
    graphs with a gather per parameter, stage 1 (its post-step gather is eager code), and the
    gather pass disabled (each marker's eager body gathers)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    import zerofx
    from zerofx.models import GPT, GPTConfig, random_batch

    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16)
    out = {}
    # bucket_bytes=0: a gather per parameter (the bucket pass gathers a bucket into a flat buffer
    # with the out= form on every backend)
    variants = {"stage3": {"bucket_bytes": 0}, "stage1": {"stage": 1}, "markers": {"disable_passes": ("gather",)}}
    for name, options in variants.items():
        torch.manual_seed(0)
        model = zerofx.compile(GPT(cfg), mesh, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = random_batch(cfg, 2, torch.Generator().manual_seed(rank))
        for step in range(3):  # the first compiles: its fake-tensor tracing dispatches ops too
            with profile(activities=[ProfilerActivity.CPU]) if step else contextlib.nullcontext() as prof:
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
        names = [e.name for e in prof.events()]
        out[name] = {
            "out_of_place": names.count(_OUT_OF_PLACE),
            "out_form": names.count(_OUT_FORM),
            "pair": names.count(_PAIR),
        }
        torch._dynamo.reset()
    dist.barrier()
    return out


def test_no_out_of_place_all_gather_is_issued_on_gloo():
    for rank, result in enumerate(run_ranks(gathers_dispatched, 2, timeout=600)):
        for variant, counts in result.items():
            assert counts["out_of_place"] == 0, (rank, variant, counts)
            # the profiler does see them: graphs over two ranks exchange (passes/exchange.py),
            # eager code (stage 1's post-step gather, the markers' bodies) gathers in the out= form
            assert counts["pair" if variant == "stage3" else "out_form"] > 0, (rank, variant, counts)


class ManySmall(torch.nn.Module):
    """Twelve small parameters read by one op: with bucketing and scheduling off, the forward
    issues all twelve all-gathers before it waits for the first."""

    def __init__(self, count: int = 12, width: int = 64):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width)) for _ in range(count))

    def forward(self, x):
        return (x * torch.stack(list(self.ps)).sum(0)).square().mean()


def gathers_in_flight(rank: int, world: int, steps: int, broken: bool) -> dict:
    import faulthandler

    from torch.distributed.device_mesh import init_device_mesh

    from zerofx.api import _compile
    from zerofx.ir.collectives import ALL_GATHER, ALL_GATHER_OUT
    from zerofx.passes import transport
    from zerofx.runtime.params import runtime_of

    faulthandler.enable()  # an abort prints each thread's stack
    if broken:  # the rewrite off: the graphs keep torch's out-of-place all-gather
        transport._gather_into_buffers = lambda gm, ctx, backends: None
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    # exchange off: over two ranks it would turn these into pair exchanges (all-to-alls); this
    # test is about gloo's all-gather with many in flight, which groups of more ranks still run
    options = {"disable_passes": ("bucket", "schedule", "exchange")}
    model = _compile(ManySmall(), mesh, None, options, keep_graphs=True)
    x = torch.randn(4, 64)
    for _ in range(steps):
        model(x).backward()
    issued = 0
    for gm in runtime_of(model).compiled.graphs.values():
        pending = 0
        for node in gm.graph.nodes:
            if node.target in (ALL_GATHER, ALL_GATHER_OUT):
                pending += 1
                issued = max(issued, pending)
            elif node.target is transport.WAIT:
                pending -= 1
    return {"most_in_flight": issued}


def test_many_all_gathers_in_flight_on_gloo_train():
    for result in run_ranks(gathers_in_flight, 2, 1000, False, timeout=600):
        assert result["most_in_flight"] == 12, result


def test_disabling_transport_on_gloo_warns(monkeypatch):
    import warnings

    from torch.fx.experimental.proxy_tensor import make_fx

    from zerofx import backend
    from zerofx.ir.collectives import ALL_GATHER

    def gathers(x):
        return torch.ops._c10d_functional.all_gather_into_tensor(x, 2, "g") * 2

    gm = make_fx(gathers, tracing_mode="fake")(torch.randn(3))
    assert any(n.target is ALL_GATHER for n in gm.graph.nodes)
    monkeypatch.setattr(backend, "_WARNED", set())
    monkeypatch.setattr(backend, "backend_of", lambda group: "nccl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend._warn_if_out_of_place_gathers(gm)  # NCCL keeps the out-of-place op: no warning
    monkeypatch.setattr(backend, "backend_of", lambda group: "gloo")
    with pytest.warns(UserWarning, match="keeps torch's out-of-place all-gather on a gloo group"):
        backend._warn_if_out_of_place_gathers(gm)
