"""FusedAdamW against torch.optim.AdamW, step for step (Triton interpreter, CPU).

Tolerance: fp32, rtol = atol = 1e-6 on parameters and both moments after every step. The
kernel repeats torch's op order, so what differs is rounding inside single ops (numpy's sqrt
and division vs ATen's vectorised kernels, which may fuse a multiply-add): measured differences
are about one ulp. A wrong formula (a missed bias correction, decay applied to the moment) is
off by orders of magnitude more: lr is 1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zerofx.codegen.fused_adamw import FusedAdamW

pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = dict(rtol=1e-6, atol=1e-6)
SHAPES = [(7, 5), (2049,), (3,), (1, 1), (33, 2, 3)]  # one launch, several blocks, ragged ends


def _pair(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, ref


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(weight_decay=0.1, amsgrad=True),
        dict(maximize=True, betas=(0.3, 0.95), eps=1e-6),  # a lerp weight >= 0.5 takes ATen's other branch
        dict(foreach=True),  # torch's implementation choices carry over (a TypeError before)
        dict(fused=True, weight_decay=0.1),
    ],
)
def test_matches_torch_adamw_step_for_step(options):
    ours, ref = _pair()
    opt, ref_opt = FusedAdamW(ours, lr=1e-2, **options), torch.optim.AdamW(ref, lr=1e-2, **options)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        if step == 3:
            ours[2].grad = ref[2].grad = None  # a parameter without a gradient is skipped, its step too
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step} param {i}: {m}")
            s, t = opt.state[p], ref_opt.state[q]
            assert s["step"].item() == t["step"].item()
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if options.get("amsgrad") else ()):
                torch.testing.assert_close(s[key], t[key], **TOL, msg=lambda m: f"step {step} {key} {i}: {m}")


def test_a_permuted_dense_parameter_steps_in_its_storage_order():
    """A shard split along dim 1 is a dense permuted view (zerofx/ir/layout.py, NOTE: the
    sharded dim): its gradient and state share its strides and the kernel walks their memory
    in storage order, as torch's step on the same values. A gradient laid out otherwise is
    copied into that order (pairing it flat would update the wrong elements)."""
    gen = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(6, 4, 5, generator=gen).movedim(0, 1))  # [4, 6, 5], permuted
    ref = torch.nn.Parameter(ours.detach().clone(memory_format=torch.contiguous_format))
    assert not ours.is_contiguous()
    opt, ref_opt = FusedAdamW([ours], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    for step in range(3):
        g = torch.randn(6, 4, 5, generator=gen).movedim(0, 1)
        ours.grad, ref.grad = g.clone(), g.contiguous()
        assert ours.grad.stride() == ours.stride()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(ours, ref, **TOL, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(opt.state[ours]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"], **TOL)
    g = torch.randn(4, 6, 5, generator=gen)  # contiguous: not the parameter's layout
    ours.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(opt.state[ours]["exp_avg"], ref_opt.state[ref]["exp_avg"], **TOL)


def test_a_gradient_laid_out_otherwise_than_a_contiguous_parameter_is_paired_by_element():
    ours, ref = _pair()
    opt, ref_opt = FusedAdamW(ours[:1], lr=1e-2), torch.optim.AdamW(ref[:1], lr=1e-2)
    g = torch.randn(5, 7).t()  # [7, 5] with strides (1, 7)
    ours[0].grad, ref[0].grad = g, g.clone()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(ours[0], ref[0], **TOL)


def test_a_parameter_that_is_not_dense_is_a_clear_error_before_any_state_changes():
    """Refused at its group's launch, the error came after an earlier group had stepped and every
    parameter's step count had grown: a loop that caught it and moved to torch's AdamW carried a
    wrong bias correction. Refused before any state changes, as fp64 parameters are."""
    from zerofx.errors import ZeroFXError

    first = torch.nn.Parameter(torch.randn(4))
    p = torch.nn.Parameter(torch.randn(6, 8)[:, :5])
    last = torch.nn.Parameter(torch.randn(3))
    for t in (first, p, last):
        t.grad = torch.randn_like(t)
    before = first.detach().clone()
    opt = FusedAdamW([{"params": [first]}, {"params": [p, last]}], lr=1e-2)
    with pytest.raises(ZeroFXError, match="not dense"):
        opt.step()
    assert torch.equal(first, before) and not opt.state


def test_a_float64_parameter_is_refused_before_any_state_changes():
    """The kernel computes in fp32: an fp64 parameter came back rounded to fp32 at every step
    (lr 1e-9 moved values by up to 6e-8). Refused, naming torch's AdamW, with no state made."""
    from zerofx.errors import ZeroFXError

    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    p.grad = torch.randn(5, dtype=torch.float64)
    opt = FusedAdamW([p], lr=1e-9)
    with pytest.raises(ZeroFXError, match="computes in fp32: a float64 parameter"):
        opt.step()
    assert not opt.state


def test_without_a_device_or_the_interpreter_it_says_so(tmp_path):
    """On CPU without TRITON_INTERPRET a step failed inside Triton ("0 active drivers")."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from zerofx.codegen.fused_adamw import FusedAdamW\n"
        "p = torch.nn.Parameter(torch.randn(4)); p.grad = torch.randn(4)\n"
        "FusedAdamW([p]).step()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0
    assert "ZeroFXError: FusedAdamW runs one Triton kernel" in run.stderr and "TRITON_INTERPRET=1" in run.stderr, (
        run.stderr[-2000:]
    )


def test_a_tensor_lr_is_read_at_every_step():
    ours, ref = _pair()
    lr, ref_lr = torch.tensor(1e-2), torch.tensor(1e-2)
    opt, ref_opt = FusedAdamW(ours, lr=lr), torch.optim.AdamW(ref, lr=ref_lr)
    for step in range(3):
        for p, q in zip(ours, ref):
            p.grad, q.grad = torch.ones_like(p) * (step - 1), torch.ones_like(q) * (step - 1)
        opt.step()
        ref_opt.step()
        lr.mul_(0.5)  # as a scheduler updating it in place
        ref_lr.mul_(0.5)
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, **TOL)
    with pytest.raises(ValueError, match="one element"):
        FusedAdamW(ours, lr=torch.ones(2))


def test_tensor_betas_step_as_torch_and_nan_hyperparameters_are_refused():
    """torch's AdamW takes betas as tensors (their values at each step); FusedAdamW accepted
    them and then failed inside the kernel's launch, after counting the step. A NaN lr (or eps,
    weight decay, beta) passed its ``< 0`` checks and turned every parameter NaN at the first
    step; torch's AdamW refuses it."""
    ours, ref = _pair()
    opt = FusedAdamW(ours, lr=1e-2, betas=(torch.tensor(0.8), torch.tensor(0.99)))
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(torch.tensor(0.8), torch.tensor(0.99)))
    for step in range(2):
        for p, q in zip(ours, ref):
            p.grad, q.grad = torch.ones_like(p) * (step + 1), torch.ones_like(q) * (step + 1)
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, **TOL)
    nan = float("nan")
    for bad in ({"lr": nan}, {"eps": nan}, {"weight_decay": nan}, {"betas": (nan, 0.999)}, {"betas": (0.9, nan)}):
        with pytest.raises(ValueError, match="invalid AdamW hyperparameters"):
            FusedAdamW(ours, **bad)


def test_state_dict_moves_between_fused_and_torch():
    ours, ref = _pair()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    for p in ref:
        p.grad = torch.ones_like(p)
    ref_opt.step()
    with torch.no_grad():
        for p, q in zip(ours, ref):
            p.copy_(q)
    opt = FusedAdamW(ours, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # a same-dtype load would share tensors
    for p, q in zip(ours, ref):
        p.grad, q.grad = torch.full_like(p, -0.5), torch.full_like(q, -0.5)
    opt.step()
    ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, **TOL)
    assert set(opt.state_dict()["state"][0]) == set(ref_opt.state_dict()["state"][0])


def test_one_launch_per_group(monkeypatch):
    import zerofx.codegen.fused_adamw as fused_adamw

    calls = []
    real = fused_adamw.adamw_step
    monkeypatch.setattr(
        fused_adamw, "adamw_step", lambda params, *a, **k: (calls.append(len(params)), real(params, *a, **k))
    )
    ours, _ = _pair()
    opt = FusedAdamW(ours, lr=1e-2)
    for p in ours:
        p.grad = torch.randn_like(p)
    opt.step()
    assert calls == [len(SHAPES)]
