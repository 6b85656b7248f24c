"""Each family of generated kernel against the ATen graph it replaces (Triton interpreter, CPU).

Every test traces a small function to an ATen graph, compiles it with the "triton" codegen, and
runs both on the same inputs. It also asserts that codegen really claimed the ops (kernels were
launched, none fell back), so a silently unfused graph cannot pass. Tolerances, per family:

* fp32 arithmetic (+ - * /, comparisons, where, relu, max/min): bit-exact, IEEE ops agree;
* fp32 transcendentals (exp, log, erf, sigmoid, tanh, sqrt, rsqrt): rtol 1e-5, atol 1e-6
  (numpy in the interpreter vs ATen's vectorised math; tanh is written via exp and log);
* reductions (softmax, log_softmax, LayerNorm, RMSNorm, fwd and bwd): rtol 1e-5, atol 1e-5
  (a different summation order);
* bf16 / fp16: rtol = atol = 2e-2 / 2e-3, i.e. about two units in the last place: the kernel
  rounds once at the store while eager rounds after every op, and the interpreter's
  fp32 -> bf16 cast truncates where GPUs round to nearest.

Shapes are small but ragged (not powers of two, more than one program per kernel) so masks are
exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from zerofx.codegen.triton_codegen import compile_triton
from zerofx.codegen.triton_runtime import FusedKernel, cache_info

pytestmark = pytest.mark.usefixtures("triton_interpreter")

aten = torch.ops.aten
TRANSCENDENTAL = dict(rtol=1e-5, atol=1e-6)
REDUCTION = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)
FP16 = dict(rtol=2e-3, atol=2e-3)


def kernels_of(gm: torch.fx.GraphModule) -> list[FusedKernel]:
    return [n.target for n in gm.graph.nodes if isinstance(n.target, FusedKernel)]


def run_both(fn, *inputs, min_kernels: int = 1):
    """(ATen outputs, Triton outputs, kernels) of ``fn`` traced on ``inputs``."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    fused = compile_triton(gm)
    kernels = kernels_of(fused)
    assert len(kernels) >= min_kernels, fused.code
    ref, got = gm(*inputs), fused(*inputs)
    for k in kernels:
        assert k.error is None, k.error
        assert k.launches == 1 and k.fallbacks == 0, k
    flat = lambda o: list(o) if isinstance(o, (tuple, list)) else [o]  # noqa: E731
    return flat(ref), flat(got), kernels


def test_pointwise_fp32_is_exact_with_broadcast_strided_inputs_and_ragged_size():
    x = torch.randn(37, 83)
    y = torch.randn(83, 37).t()  # a transposed view: strides (1, 37)
    b = torch.randn(83)
    keep = torch.rand(37, 83) > 0.3

    def fn(x, y, b, keep):
        h = torch.where(x > 0, x * y + b, (x - b) / (y.abs() + 1.0))
        h = torch.where(keep, h.relu() * 2 - x, torch.maximum(h, y))
        return h, h < 0.5

    ref, got, kernels = run_both(fn, x, y, b, keep)
    assert kernels[0].kernel.kind == "pointwise"
    assert "mask = offs < 3071" in kernels[0].kernel.source  # 37*83: three programs, the last ragged
    for r, g in zip(ref, got):
        assert r.dtype == g.dtype
        assert torch.equal(r, g)


def test_pointwise_transcendentals():
    x = torch.randn(5, 301)

    def fn(x):
        # well-conditioned compositions, so per-op rounding is all that can differ
        a = torch.exp(x * 0.5) + torch.log(x.abs() + 1.0) - torch.sigmoid(x) * torch.tanh(x)
        return torch.erf(a) + torch.sqrt(a.abs() + 1.0) * torch.rsqrt(x * x + 1.0) + a.pow(2) - (1.0 / (a.abs() + 1))

    (ref,), (got,), _ = run_both(fn, x)
    torch.testing.assert_close(got, ref, **TRANSCENDENTAL)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forward_and_backward(approximate):
    x, g = torch.randn(6, 170), torch.randn(6, 170)

    def fn(x, g):
        return aten.gelu(x, approximate=approximate), aten.gelu_backward(g, x, approximate=approximate)

    ref, got, kernels = run_both(fn, x, g)
    assert len(kernels) == 1  # forward and backward read the same x: two outputs of one kernel
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, **TRANSCENDENTAL)


def test_softmax_log_softmax_and_their_backwards_ragged_rows():
    x, g = torch.randn(7, 10, 100), torch.randn(7, 10, 100)  # 70 rows of 100: 3 programs, cols masked

    def fn(x, g):
        s = torch.softmax(x * 2.0, dim=-1)
        ls = torch.log_softmax(x, dim=-1)
        return (
            s,
            ls,
            aten._softmax_backward_data(g, s, -1, torch.float32),
            aten._log_softmax_backward_data(g, ls, -1, torch.float32),
        )

    ref, got, kernels = run_both(fn, x, g)
    assert all(k.kernel.kind == "row" for k in kernels)
    assert "mask = row_mask & (cols < 100)" in kernels[0].kernel.source
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, **REDUCTION)


def test_layer_norm_forward_and_backward_with_residual():
    x, r = torch.randn(3, 9, 48), torch.randn(3, 9, 48)
    w, b, g = torch.randn(48), torch.randn(48), torch.randn(3, 9, 48)

    def fn(x, r, w, b, g):
        h = x + r
        y, mean, rstd = aten.native_layer_norm(h, [48], w, b, 1e-5)
        dx, dw, db = aten.native_layer_norm_backward(g, h, [48], mean, rstd, w, b, [True, True, True])
        return y, mean, rstd, dx + g, dw, db

    ref, got, kernels = run_both(fn, x, r, w, b, g)
    assert any("tl.sum(" in k.kernel.source for k in kernels)
    for rr, o in zip(ref, got):
        torch.testing.assert_close(o, rr, **REDUCTION)


def test_rms_norm_forward_and_backward_through_autograd():
    x, w, g = torch.randn(4, 5, 40), torch.randn(40), torch.randn(4, 5, 40)

    def rms_norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def fn(x, w, g):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = rms_norm(x, w)
        return (y, *torch.autograd.grad(y, (x, w), g))

    ref, got, kernels = run_both(fn, x, w, g, min_kernels=1)
    assert any(k.kernel.kind == "row" for k in kernels)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, **REDUCTION)


def test_per_row_tensors_are_read_and_written_inside_full_row_kernels():
    """F.normalize's backward as AOTAutograd recomputes it: whole rows divided by the per-row
    norm read directly (an (R, 1) load under the full tile), and the clamped norm expanded along
    the row returned for a later kernel (a stride-0 output: one element per row stored)."""
    x, norm, m = torch.randn(5, 40), torch.rand(5, 1) + 0.5, torch.randn(5, 5)

    def fn(x, norm, m):
        expand = norm.clamp_min(1e-12).expand(5, 40)
        y = x / expand
        grad = m @ y + m.t() @ y
        inner = (-grad * (y / expand)).sum(1, keepdim=True)
        scaled = (x / norm.detach()).masked_fill(norm.detach() == 0, 0.0)
        return grad / expand + torch.where(norm >= 1e-12, inner, 0.0) * scaled

    ref, got, kernels = run_both(fn, x, norm, m, min_kernels=2)
    assert any(k.kernel.kind == "row" for k in kernels)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, **REDUCTION)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, BF16), (torch.float16, FP16)])
def test_low_precision_layer_norm_and_pointwise(dtype, tol):
    x = torch.randn(6, 50, dtype=dtype)
    w, b = torch.randn(50, dtype=dtype), torch.randn(50, dtype=dtype)

    def fn(x, w, b):
        y = F.layer_norm(x * 1.5 + 0.25, (50,), w, b)
        return F.gelu(y) * 2.0, torch.softmax(x.float(), -1).to(dtype)

    ref, got, kernels = run_both(fn, x, w, b)
    for r, o in zip(ref, got):
        assert o.dtype == r.dtype == dtype
        torch.testing.assert_close(o.float(), r.float(), **tol)


def test_outputs_keep_the_layout_the_graph_promised():
    x = torch.randn(30, 20).t()  # pointwise ops on a transposed input keep it transposed in ATen

    def fn(x):
        return (x * 2 + 1).exp()

    (ref,), (got,), _ = run_both(fn, x)
    assert got.stride() == ref.stride() == (1, 20)
    torch.testing.assert_close(got, ref, **TRANSCENDENTAL)


def test_identical_groups_share_one_compiled_kernel():
    x, y = torch.randn(3, 33), torch.randn(3, 33)

    def fn(x, y):
        a = torch.sigmoid(x * 3.0) + 1.0
        b = torch.sigmoid(y * 3.0) + 1.0  # the same group again, on another input
        return a, b.mm(b.t())

    before = cache_info()
    ref, got, kernels = run_both(fn, x, y, min_kernels=2)
    after = cache_info()
    assert len(kernels) == 2 and kernels[0].kernel.signature == kernels[1].kernel.signature
    assert after["misses"] - before["misses"] <= 1 and after["hits"] - before["hits"] >= 1
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, **TRANSCENDENTAL)


def test_autotune_is_emitted_for_gpus_only(monkeypatch):
    from zerofx.codegen.decompose import decompose_for_codegen
    from zerofx.codegen.fusion import find_groups, group_io
    from zerofx.codegen.triton_emit import emit_group
    from zerofx.codegen.triton_ops import can_lower

    gm = make_fx(lambda x: torch.softmax(x, -1) * 2, tracing_mode="fake")(torch.randn(6, 40))
    decompose_for_codegen(gm, can_lower)
    (group,) = find_groups(gm)
    args = (group.members, group.shape, group.classes, *group_io(group))
    assert "triton.autotune" not in emit_group(*args, autotune=True).source  # the interpreter cannot time kernels
    monkeypatch.delenv("TRITON_INTERPRET")
    tuned = emit_group(*args, autotune=True)
    assert "@triton.autotune(configs=[" in tuned.source and "BLOCK_R=" not in tuned.source.split("def launch")[1]
    assert tuned.signature != emit_group(*args).signature
    compile(tuned.source, "<tuned>", "exec")  # valid Python; only a GPU can run it


def test_var_mean_with_default_correction_is_unbiased():
    x = torch.randn(9, 21)

    def fn(x):
        var, mean = aten.var_mean.correction(x, [-1], correction=None, keepdim=True)  # None means 1
        return (x - mean) / (var + 1.0)

    (ref,), (got,), _ = run_both(fn, x)
    torch.testing.assert_close(got, ref, **REDUCTION)


def test_rsub_alpha_scales_the_tensor_operand():
    """``rsub(x, other, alpha)`` is ``other - alpha * x`` (alpha positional in rsub.Scalar)."""
    x, y = torch.randn(7, 13), torch.randn(7, 13)

    def fn(x, y):
        return aten.rsub.Scalar(x * 2, 5.0, 3) + 1, aten.rsub.Tensor(x * 2, y, alpha=3) + 1, torch.sub(x, y, alpha=-0.5)

    ref, got, _ = run_both(fn, x, y)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_arithmetic_with_a_bool_result_stays_aten():
    """torch's add on bools is a logical or (True + True is True), mul a logical and: int1
    arithmetic in a kernel would differ, so those ops are not lowered; comparisons, logical ops
    (floats included: nonzero is true), where and casts still are."""
    from zerofx.codegen.triton_ops import can_lower

    a = torch.tensor([[True, True, False, False]] * 3)
    b = torch.tensor([[True, False, True, False]] * 3)
    x = torch.tensor([[0.0, 2.0, -1.0, 0.0]] * 3)

    def fn(a, b, x):
        return torch.logical_not(a + b), (a * b) + a, torch.where(a, b, a) + b, torch.logical_and(x * 2, x - 1) | a

    gm = make_fx(fn, tracing_mode="fake")(a, b, x)
    adds = [
        n
        for n in gm.graph.nodes
        if n.target in (aten.add.Tensor, aten.mul.Tensor) and n.meta["val"].dtype == torch.bool
    ]
    assert adds and not any(can_lower(n) for n in adds)
    fused = compile_triton(gm)
    for r, g in zip(gm(a, b, x), fused(a, b, x)):
        assert torch.equal(g, r)
    assert kernels_of(fused) and all(k.fallbacks == 0 and k.error is None for k in kernels_of(fused))


def test_amax_amin_of_a_row_holding_nan_are_nan():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 2.0], [-inf, -inf, -inf], [1.0, 2.0, inf], [nan, -inf, 0.5]])

    def fn(x):
        return (x * 1).amax(-1) + 0, (x * 1).amin(-1, keepdim=True) + x, torch.softmax(x, -1)

    ref, got, kernels = run_both(fn, x)
    assert all(k.kernel.kind == "row" for k in kernels)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_pow_zero_of_inf_and_nan_is_one_and_tanh_is_accurate_near_zero():
    z = torch.tensor([[float("inf"), float("nan"), -0.0, -float("inf"), 2.0, 0.0]])
    (ref,), (got,), _ = run_both(lambda z: (z * 1.0).pow(0) + 0, z)
    assert torch.equal(got, ref)
    t = torch.tensor([[1e-8, -3e-8, 1e-5, 1e-3, -1e-4, 0.05, 0.3, -0.7, 5.0, 20.0, -20.0, float("inf"), -0.0]])
    (ref,), (got,), _ = run_both(lambda t: torch.tanh(t * 1.0) * 1.0, t)
    torch.testing.assert_close(got, ref, rtol=4e-7, atol=0)  # relative: 2 / (1 + exp(-2x)) - 1 cancels near 0
    assert got[0, -1].item() == 0.0 and got[0, -1].signbit()  # tanh(-0.0) = -0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_comparisons_give_eagers_booleans(dtype):
    """Torch compares a bf16 / fp16 tensor with a Python scalar (or a 0-dim fp32 tensor) in the
    tensor's dtype: ``x > 0.1`` compares with 0.1 rounded to it. The kernel's fp32 registers
    compared with 0.1 itself, so a value equal to the rounded threshold came out on the other
    side (booleans that no store rounds back): the same booleans as eager, exactly."""
    x = torch.tensor([0.1, 0.2, 0.3, 1 / 3, 0.7, 1.1, 100.3], dtype=dtype).repeat(5)
    limit = torch.tensor(0.3)  # 0-dim fp32: rounded to the tensor's dtype, as the scalar

    def fn(x, limit):
        y = x * 1.0
        return y == 0.1, y > 0.1, y >= 0.3, y <= 1 / 3, y != 0.7, y < limit, torch.where(x > 0.1, x, 0.0) * 2

    ref, got, _ = run_both(fn, x, limit)
    assert any(r.any() for r in ref[:-1]) and not all(r.all() for r in ref[:-1])  # thresholds that split
    for r, g in zip(ref, got):
        assert r.dtype == g.dtype and torch.equal(r, g), (r, g)


def test_var_mean_with_a_correction_past_the_row_length_is_inf_as_aten():
    """ATen divides by max(n - correction, 0): inf, never the negative variance that dividing
    by n - correction gave."""
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 3.5]])

    def fn(x):
        var, mean = aten.var_mean.correction(x * 1.0, [-1], correction=3, keepdim=True)
        return var + 0, mean * 2

    ref, got, _ = run_both(fn, x)
    assert torch.isinf(ref[0]).all()
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, **REDUCTION)
