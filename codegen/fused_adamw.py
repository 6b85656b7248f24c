"""AdamW as one Triton launch per bucket of parameter shards.

``torch.optim.AdamW`` on CPU (and on GPU without ``foreach``/``fused``) runs about ten small
kernels per parameter; with ZeRO every parameter is a shard, so a model's step is hundreds of
tiny launches. ``FusedAdamW`` updates every shard of a group in one kernel: a pointer table
addresses the parameters, gradients and the two moment buffers (codegen/multi_tensor.py).

It is a drop-in ``torch.optim.Optimizer``: same hyperparameters, same state names (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so state dicts move between it and
``torch.optim.AdamW``; DTensor parameters (zerofx's shards) are updated through their local
tensors. The arithmetic follows torch's single-tensor AdamW op by op (decay, ``lerp`` of the
first moment, ``mul``/``addcmul`` of the second, ``addcdiv``), in fp32 registers whatever the
storage dtype; in fp32 it matches torch to rounding (see tests/test_codegen_optimizer.py).

A launch needs one dtype per tensor list and one step count, so parameters are grouped by
(device, dtypes, step): normally that is one group, hence one kernel, per param group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
import triton.language as tl

from zerofx.codegen.multi_tensor import BLOCK, addresses, blocks_for, in_storage_order, int_table, jit, local, tl_dtype
from zerofx.errors import ZeroFXError


def _adamw_kernel(
    p_ptrs,
    g_ptrs,
    m_ptrs,
    v_ptrs,
    vmax_ptrs,
    numels,
    block_tensor,
    block_start,
    decay,
    lerp_weight,
    beta2,
    one_minus_beta2,
    neg_step_size,
    bias_correction2_sqrt,
    eps,
    P: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    LERP_LOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.load(block_tensor + b)
    e = tl.load(block_start + b) + tl.arange(0, BLOCK)
    mask = e < tl.load(numels + t)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(S))
    v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(S))
    p = tl.load(p_ptr + e, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(tl.load(g_ptrs + t).to(tl.pointer_type(G)) + e, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + e, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + e, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = p * decay  # param.mul_(1 - lr * weight_decay)
    if LERP_LOW:  # exp_avg.lerp_(grad, 1 - beta1), in ATen's two-branch form
        m = m + lerp_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - lerp_weight)
    v = v * beta2 + one_minus_beta2 * g * g  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    if AMSGRAD:
        vmax_ptr = tl.load(vmax_ptrs + t).to(tl.pointer_type(S))
        vmax = tl.maximum(tl.load(vmax_ptr + e, mask=mask, other=0.0).to(tl.float32), v)
        tl.store(vmax_ptr + e, vmax.to(S), mask=mask)
        denom = tl.sqrt(vmax) / bias_correction2_sqrt + eps
    else:
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p + neg_step_size * m / denom  # param.addcdiv_(exp_avg, denom, value=-step_size)
    tl.store(p_ptr + e, p.to(P), mask=mask)
    tl.store(m_ptr + e, m.to(S), mask=mask)
    tl.store(v_ptr + e, v.to(S), mask=mask)


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor] | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> None:
    """One AdamW update of every tensor in the lists, in a single launch (all updated in place).

    Every list must hold tensors of one dtype on one device, each laid out as its parameter,
    contiguous or a dense permuted view (a Shard(k) shard: ``in_storage_order``; a gradient laid
    out otherwise is copied into that order, a parameter that is not dense is a ZeroFXError);
    ``step`` is the step number after this update (1 on the first call), as in torch's bias
    corrections.
    """
    if not params:
        return
    amsgrad = max_exp_avg_sqs is not None
    lists = [params, grads, exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if amsgrad else [])]
    # each parameter's tensors in its storage order: a Shard(k) shard is a dense permuted view
    ordered = [in_storage_order(*(local(t) for t in ts)) for ts in zip(*lists)]
    for o in ordered:
        _refuse_not_dense(o[0], o[2:])
    params, grads, exp_avgs, exp_avg_sqs = ([o[k] for o in ordered] for k in range(4))
    # a gradient laid out otherwise than its parameter is only read: a copy in the parameter's
    # storage order keeps every element paired with its parameter's
    grads = [g.contiguous() for g in grads]
    if amsgrad:
        max_exp_avg_sqs = [o[4] for o in ordered]
    device = params[0].device
    numels = [p.numel() for p in params]
    blocks = blocks_for(numels, device)
    if not blocks.count:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    lerp_weight = 1 - beta1
    p_table = addresses(params, device)
    vmax_table = addresses([local(v) for v in max_exp_avg_sqs], device) if amsgrad else p_table
    jit(_adamw_kernel)[(blocks.count,)](
        p_table,
        addresses(grads, device),
        addresses(exp_avgs, device),
        addresses(exp_avg_sqs, device),
        vmax_table,
        int_table(numels, device),
        blocks.tensor,
        blocks.start,
        1 - lr * weight_decay,
        lerp_weight,
        beta2,
        1 - beta2,
        -(lr / bias_correction1),
        bias_correction2**0.5,
        eps,
        P=tl_dtype(params[0].dtype),
        G=tl_dtype(grads[0].dtype),
        S=tl_dtype(exp_avgs[0].dtype),
        AMSGRAD=amsgrad,
        MAXIMIZE=maximize,
        LERP_LOW=lerp_weight < 0.5,
        BLOCK=BLOCK,
    )


def _refuse_not_dense(param: torch.Tensor, state: list[torch.Tensor]) -> None:
    """A parameter and its state, in the parameter's storage order, are updated in place: each
    must be one dense block (no copy can stand in)."""
    if not all(t.is_contiguous() for t in (param, *state)):
        raise ZeroFXError(
            f"FusedAdamW: a parameter of shape {tuple(param.shape)} (strides {param.stride()}) or its "
            "optimizer state is not dense (e.g. a slice of a larger tensor); use torch.optim.AdamW for it"
        )


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with one Triton kernel per group of shards (see the module docstring).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (for tests).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        # foreach / fused: torch's AdamW's choice of implementation, accepted so that its
        # arguments carry over; here every group is one launch whatever they say
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"FusedAdamW: a tensor lr must hold one element, got shape {tuple(lr.shape)}")
        # written so that NaN fails each test (NaN < 0 is False: a NaN lr turned every parameter NaN)
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(
                f"invalid AdamW hyperparameters lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    def _state_of(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _refuse_what_it_cannot_step(self) -> None:
        """Before any state changes: parameters the kernel cannot update as torch's AdamW would.
        Its arithmetic is fp32 (registers and scalar arguments), so an fp64 parameter would be
        rounded to fp32 at every step; a device Triton cannot launch on would fail inside Triton;
        a parameter (or state) that is not one dense block cannot be updated in place (refused
        here, not at its group's launch, after earlier groups stepped and every step count grew)."""
        from zerofx.codegen.triton_runtime import launch_problem

        devices = set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("FusedAdamW supports dense real parameters only")
                if p.dtype == torch.float64 or self.state.get(p, {}).get("exp_avg", p).dtype == torch.float64:
                    raise ZeroFXError(
                        f"FusedAdamW computes in fp32: a float64 parameter (shape {tuple(p.shape)}) would be rounded "
                        "to fp32 at every step; use torch.optim.AdamW for fp64 parameters"
                    )
                state = [local(v) for k, v in self.state.get(p, {}).items() if k != "step"]
                ordered = in_storage_order(local(p), *state)
                _refuse_not_dense(ordered[0], ordered[1:])
                devices.add(p.device)
        for device in devices:
            problem = launch_problem(device)
            if problem is not None:
                raise ZeroFXError(
                    f"FusedAdamW runs one Triton kernel per group of shards, and here it cannot: {problem}"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_what_it_cannot_step()
        for group in self.param_groups:
            beta1, beta2 = map(float, group["betas"])  # torch's AdamW takes tensor betas too: their values now
            buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_of(p, group["amsgrad"])
                state["step"] += 1
                key = (p.device, p.dtype, p.grad.dtype, state["exp_avg"].dtype, int(state["step"].item()))
                buckets[key].append(p)
            for (_, _, _, _, step), ps in buckets.items():
                states = [self.state[p] for p in ps]
                adamw_step(
                    ps,
                    [p.grad for p in ps],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else None,
                    step=step,
                    lr=float(group["lr"]),  # a tensor lr (a scheduler may update it in place): its value now
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    maximize=group["maximize"],
                )
        return loss
