"""Issue 13's heap-corruption suspect, checked at run time: a gloo buffer freed under its collective.

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

import os

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
        if getattr(func, "namespace", None) == "_c10d_functional":
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
