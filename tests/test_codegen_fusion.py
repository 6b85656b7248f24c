"""The fusion rules and the codegen's fallbacks: what is grouped, what never is, and what happens
when something cannot be generated, compiled or launched (Triton interpreter, CPU)."""

from __future__ import annotations

import logging
import operator

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import zerofx.codegen.triton_codegen as triton_codegen
from zerofx.codegen.fusion import Claimed, find_groups, group_io, is_comm, replace_groups
from zerofx.codegen.triton_emit import KernelSource
from zerofx.codegen.triton_runtime import FusedKernel
from zerofx.dump import Recorder
from zerofx.ir.collectives import ALL_GATHER, WAIT
from zerofx.passes.pipeline import PassContext

pytestmark = pytest.mark.usefixtures("triton_interpreter")
aten = torch.ops.aten


def _graph_with_collectives() -> fx.GraphModule:
    """Three pointwise pairs separated by an all-gather issue and its wait (a hand-made graph)::

    a1 = x * 2; a2 = a1 + 1 | ag = all_gather(s) | b1 = a2 * 3; b2 = b1 - 1 | w = wait(ag) | c1 = b2 * w; c2 = c1 + 1
    """
    mode = FakeTensorMode()
    g = fx.Graph()

    def call(name, target, *args):
        node = g.create_node("call_function", target, args, name=name)
        with mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        return node

    x, s = g.placeholder("x"), g.placeholder("s")
    with mode:
        x.meta["val"], s.meta["val"] = torch.empty(4, 8), torch.empty(2, 8)
    a2 = call("a2", aten.add.Tensor, call("a1", aten.mul.Tensor, x, 2.0), 1.0)
    ag = g.call_function(ALL_GATHER, (s, 2, "0"))
    with mode:
        ag.meta["val"] = torch.empty(4, 8)
    b2 = call("b2", aten.sub.Tensor, call("b1", aten.mul.Tensor, a2, 3.0), 1.0)
    w = g.call_function(WAIT, (ag,))
    w.meta["val"] = ag.meta["val"]
    c2 = call("c2", aten.add.Tensor, call("c1", aten.mul.Tensor, b2, w), 1.0)
    g.output((c2,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_groups_never_span_a_collective_and_keep_their_place_between_them():
    gm = _graph_with_collectives()
    groups = find_groups(gm)
    names = sorted(tuple(n.name for n in grp.members) for grp in groups)
    assert names == [("a1", "a2"), ("b1", "b2"), ("c1", "c2")], names

    def stub(i):
        def fn(*args):
            raise AssertionError("not run")

        fn.__name__ = f"kernel{i}"
        return fn

    claimed = [Claimed(grp, *group_io(grp), stub(i)) for i, grp in enumerate(groups)]
    out = replace_groups(gm, claimed)
    order = [n.name for n in out.graph.nodes if is_comm(n) or n.name.startswith("kernel")]
    first_members = {f"kernel{i}": grp.members[0].name for i, grp in enumerate(groups)}
    expected = {"a1": 0, "b1": 2, "c1": 4}  # before the gather, between issue and wait, after it
    for kernel, member in first_members.items():
        assert order.index(kernel) == expected[member], order


def test_no_group_through_an_outside_node():
    # relu and the add would make one pointwise pair, but the add also reads mm(relu(x)):
    # running both as one kernel would need mm's result before the kernel has produced relu.
    def fn(x, w):
        r = torch.relu(x)
        return (r + r.mm(w)) * 2.0

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
    groups = find_groups(gm)
    for grp in groups:
        assert not {"relu", "add"} <= {n.name for n in grp.members}
    fused = triton_codegen.compile_triton(gm)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.equal(fused(x, w), gm(x, w))


def test_unsupported_op_stays_aten_with_a_debug_line(caplog):
    def fn(x):
        return ((x * 2 + 1).cumsum(-1).exp() * 3).sum()

    x = torch.randn(5, 7)
    gm = make_fx(fn, tracing_mode="fake")(x)
    with caplog.at_level(logging.DEBUG, logger="zerofx.codegen"):
        fused = triton_codegen.compile_triton(gm)
    assert any("cumsum" in r.getMessage() and "stays an ATen call" in r.getMessage() for r in caplog.records)
    targets = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert aten.cumsum.default in targets
    assert sum(isinstance(t, FusedKernel) for t in targets) == 2  # the chains on either side
    torch.testing.assert_close(fused(x), gm(x), rtol=1e-5, atol=1e-5)


def _broken(source: KernelSource) -> KernelSource:
    """The same kernel, but calling a function Triton does not have."""
    bad = source.source.replace("tl.load(", "tl.no_such_load(", 1)
    return KernelSource(source.name + "_broken", bad, source.signature + "_broken", source.kind, source.blocks)


def test_kernel_failure_falls_back_to_aten_and_is_reported(monkeypatch, tmp_path):
    emit = triton_codegen.emit_group
    monkeypatch.setattr(triton_codegen, "emit_group", lambda *a, **k: _broken(emit(*a, **k)))

    def fn(x, b):
        return torch.softmax(x + b, -1) * 2.0

    x, b = torch.randn(6, 10), torch.randn(10)
    gm = make_fx(fn, tracing_mode="fake")(x, b)
    recorder = Recorder(dump_dir=tmp_path)
    fused = triton_codegen.compile_triton(gm, PassContext("frame9", "forward"), recorder)
    (kernel,) = [n.target for n in fused.graph.nodes if isinstance(n.target, FusedKernel)]
    for _ in range(2):
        # the group's (decomposed) ATen ops ran instead: equal to rounding
        torch.testing.assert_close(fused(x, b), gm(x, b), rtol=1e-6, atol=1e-6)
    assert kernel.error is not None and "no_such_load" in kernel.error
    assert kernel.launches == 0 and kernel.fallbacks == 2
    folder = tmp_path / "rank0" / "frame9_forward" / "kernels"
    assert (folder / f"{kernel.kernel.name}.FAILED.txt").read_text().strip() == kernel.error
    assert f"kernel {kernel.kernel.name} failed" in (tmp_path / "rank0" / "summary.txt").read_text()


def test_unexpected_input_layout_runs_aten():
    def fn(x):
        return torch.sigmoid(x) * x + 1.0

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8, 6))
    fused = triton_codegen.compile_triton(gm)
    (kernel,) = [n.target for n in fused.graph.nodes if isinstance(n.target, FusedKernel)]
    other = torch.randn(6, 8).t()  # same shape, transposed strides: not what the kernel was made for
    assert torch.equal(fused(other), gm(other))
    assert kernel.fallbacks == 1 and kernel.launches == 0 and kernel.error is None


def test_no_usable_triton_means_the_graph_runs_as_aten(monkeypatch, tmp_path):
    monkeypatch.setattr(triton_codegen, "launch_problem", lambda device: "no GPU here")
    gm = make_fx(lambda x: torch.exp(x) * 2, tracing_mode="fake")(torch.randn(3))
    recorder = Recorder(dump_dir=tmp_path)
    assert triton_codegen.compile_triton(gm, PassContext("frame0", "forward"), recorder) is gm
    assert "no GPU here" in (tmp_path / "rank0" / "summary.txt").read_text()


def test_a_graph_with_symbolic_sizes_runs_as_aten_with_a_warning_saying_why(caplog, tmp_path):
    """The kernels are emitted per static shape: after dynamo recompiled a frame for changing
    shapes (zerofx.compile's default dynamic='auto'), nothing lowered, without a word. Now one
    warning per frame and a note in the dump say so and name dynamic=False."""
    gm = make_fx(lambda x: torch.exp(x) * 2, tracing_mode="symbolic")(torch.randn(3, 5))
    recorder = Recorder(dump_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="zerofx.codegen"):
        for _ in range(2):
            assert triton_codegen.compile_triton(gm, PassContext("frame7", "forward"), recorder) is gm
    warned = [r.getMessage() for r in caplog.records if "sizes are symbolic" in r.getMessage()]
    assert len(warned) == 1 and "dynamic=False" in warned[0], warned
    assert "sizes are symbolic" in (tmp_path / "rank0" / "summary.txt").read_text()
    static = make_fx(lambda x: torch.exp(x) * 2, tracing_mode="fake")(torch.randn(3, 5))
    assert triton_codegen.compile_triton(static) is not static
    # a symbolic scalar input (a Python int dynamo made dynamic) next to static tensors still lowers
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with static.graph.inserting_before(next(iter(static.graph.nodes))):
        static.graph.placeholder("n").meta["val"] = ShapeEnv().create_unbacked_symint()
    static.recompile()
    assert not triton_codegen._symbolic(static)


def test_triton_executor_without_triton_installed_warns_and_runs_aten(tmp_path):
    """docs/codegen.md promises a warning and ATen where triton cannot be imported; importing the
    codegen must therefore not import triton (a fresh process, triton made unimportable)."""
    import subprocess
    import sys

    script = """
import sys
sys.modules["triton"] = None  # as if not installed
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from zerofx.codegen.executor import make_executor
gm = make_fx(lambda x: (x * 2).exp() + 1)(torch.ones(3, 4))
out = make_executor("triton")(gm)([torch.ones(3, 4)])
out = out[0] if isinstance(out, (list, tuple)) else out
assert torch.allclose(out, torch.full((3, 4), 2.0).exp() + 1), out
print("ran as ATen")
"""
    # cwd: not the repository's root, whose zerofx/ lacks passes/ and codegen/ (tox installs)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ran as ATen" in proc.stdout
    assert "triton is not installed" in proc.stderr


def test_var_mean_tuple_never_leaves_a_kernel():
    def fn(x):
        var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
        return (x - mean) * torch.rsqrt(var + 1e-5), mean

    x = torch.randn(5, 12)
    gm = make_fx(fn, tracing_mode="fake")(x)
    fused = triton_codegen.compile_triton(gm)
    tuple_users = [
        n for n in fused.graph.nodes if n.target is operator.getitem and n.args[0].target is aten.var_mean.correction
    ]
    assert not tuple_users
    ref, got = gm(x), fused(x)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_a_codegen_bug_means_the_graph_runs_as_aten(monkeypatch, tmp_path, caplog):
    def broken(gm):
        raise RuntimeError("bug in grouping")

    monkeypatch.setattr(triton_codegen, "find_groups", broken)
    gm = make_fx(lambda x: torch.exp(x) * 2, tracing_mode="fake")(torch.randn(3))
    recorder = Recorder(dump_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="zerofx.codegen"):
        assert triton_codegen.compile_triton(gm, PassContext("frame0", "forward"), recorder) is gm
    assert "bug in grouping" in caplog.text
    assert "codegen failed (RuntimeError: bug in grouping)" in (tmp_path / "rank0" / "summary.txt").read_text()


def test_ops_mixing_devices_are_not_fused():
    from zerofx.codegen.triton_ops import can_lower

    mode = FakeTensorMode()
    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    with mode:
        x.meta["val"] = torch.empty(4, device="cuda")  # fake: no GPU needed
        s.meta["val"] = torch.tensor(2.0)  # a CPU scalar tensor, which ATen lets CUDA ops read
        same = g.call_function(aten.mul.Tensor, (x, x))
        same.meta["val"] = x.meta["val"] * x.meta["val"]
        mixed = g.call_function(aten.mul.Tensor, (x, s))
        mixed.meta["val"] = x.meta["val"] * s.meta["val"]
    assert can_lower(same) and not can_lower(mixed)


def test_a_gpu_graph_that_takes_a_cpu_scalar_first_is_a_gpu_graph():
    """The graph's device was its first tensor's: a CUDA graph whose first input is a CPU scalar
    (a loss scale, a step count) was judged a CPU graph, its kernels not launched."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        s, x = torch.empty(()), torch.empty(4, 8, device="cuda")  # fake: no GPU needed
    gm = make_fx(lambda s, x: torch.softmax(x * s, -1) + 1.0, tracing_mode="fake")(s, x)
    assert triton_codegen.graph_device(gm) == torch.device("cuda", 0)
    with mode:
        c = torch.empty(3)
    assert triton_codegen.graph_device(make_fx(lambda c: c * 2, tracing_mode="fake")(c)) == torch.device("cpu")


def test_a_composite_whose_rows_are_too_long_for_a_kernel_stays_native():
    """A vocab-sized log_softmax cannot become a row kernel (MAX_ROW): opened, it would only be
    six unfused ATen ops instead of one native kernel, so it stays whole (forward and backward)."""
    from zerofx.codegen.triton_ops import MAX_ROW

    x, g = torch.randn(2, MAX_ROW + 1), torch.randn(2, MAX_ROW + 1)

    def fn(x, g):
        y = torch.log_softmax(x, -1)
        return y, aten._log_softmax_backward_data(g, y, -1, torch.float32)

    gm = make_fx(fn, tracing_mode="fake")(x, g)
    fused = triton_codegen.compile_triton(gm)
    targets = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert targets == [aten._log_softmax.default, aten._log_softmax_backward_data.default], targets
    small = make_fx(fn, tracing_mode="fake")(x[:, :100], g[:, :100])  # still opened and fused when it fits
    assert any(isinstance(t, FusedKernel) for t in (n.target for n in triton_codegen.compile_triton(small).graph.nodes))
