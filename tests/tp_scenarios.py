"""Rank-side half of tests/test_tensor_parallel.py: ZeRO on the data-parallel dimension of a
(dp, tp) mesh, the model parallelized with torch's tensor parallelism on the other.

Three models train side by side on every rank, from one initialization:

* zerofx: the TP model (``zerofx.tensor_parallel.parallelize``) given to ``zerofx.compile`` with
  ``mesh["dp"]``;
* the oracle's replica: the same TP model without zerofx, its data-parallel gradients combined
  by ``zerofx.testing.ShardedReference`` the way zerofx combines them. The TP arithmetic is the
  same on both sides, so fp32 must agree bit for bit (losses, every gradient and parameter shard);
* a single-process model (no TP, no DP) on the whole global batch: tensor parallelism splits
  matmul reductions across ranks (a row-wise layer sums partial products), so it agrees only up
  to fp32 reassociation: losses within ``SINGLE_RTOL``.

Each scenario returns plain data; the tests assert on it. Also used by the two-"node" torchrun
run (tests/tp_torchrun.py).
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import zerofx
from tests.optim_scenarios import alone, global_value, state_mismatches
from zerofx.ir.collectives import COLLECTIVE_OPS, collective_group_size, wire_bytes
from zerofx.models import GPT, GPTConfig
from zerofx.tensor_parallel import gpt_plan, hf_plan, parallelize
from zerofx.testing import ShardedReference

PER_DP_RANK = 2  # samples per data-parallel rank per step
LR = 1e-2
# fp32, against the whole-batch single process: tensor parallelism reassociates each row-wise
# matmul's sum (tp partial products, then one add) and each norm statistic's; measured
# differences are ~1e-7 relative on the loss after 4 AdamW steps (a few ulps)
SINGLE_RTOL = 1e-5
# bf16 (param_dtype) against the fp32 single process: bf16's unit roundoff is 2**-8 (0.39%),
# and every layer's inputs, weights and outputs are rounded to it; a loss of ~ln(vocab) moves
# by a few such roundings
BF16_RTOL = 3e-2


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))


def llama(seed: int = 0, kv_heads: int = 2, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _narrow(seed: int = 0) -> torch.nn.Module:
    """A width-2 hidden layer: its TP shares, (1, 8) and (8, 1), have the shapes of Adafactor's
    column and row factors of the whole matrices."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 2), torch.nn.ReLU(), torch.nn.Linear(2, 8))


def _narrow_plan(model) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"1": ColwiseParallel(), "3": RowwiseParallel()}


def _uneven(seed: int = 0) -> torch.nn.Module:
    """A 7-row embedding split over 2 TP ranks: shares of 4 and 3 rows (32 and 24 elements)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(7, 8), torch.nn.Linear(8, 8))


def _uneven_plan(model) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return {"0": RowwiseParallel(input_layouts=Replicate())}


MODELS: dict[str, tuple[Callable, Callable, Callable]] = {
    # name -> (factory, TP plan, loss(model, x, y))
    "gpt": (gpt, gpt_plan, lambda m, x, y: m(x, y)),
    "gpt-no-sp": (gpt, lambda m: gpt_plan(m, sequence_parallel=False), lambda m, x, y: m(x, y)),
    "llama": (llama, hf_plan, lambda m, x, y: m(input_ids=x, labels=y).loss),
    # as many KV heads as query heads: HF's plan shards whole KV heads, so tp=4 needs 4 of them
    "llama-kv4": (lambda seed=0: llama(seed, kv_heads=4), hf_plan, lambda m, x, y: m(input_ids=x, labels=y).loss),
    # toys for the whole-tensor step: TP shares shaped like factors, uneven TP shares
    "narrow": (_narrow, _narrow_plan, lambda m, x, y: m(x).square().mean()),
    "uneven": (_uneven, _uneven_plan, lambda m, x, y: m(x % 7).square().mean()),
}


_MESHES: dict = {}


def mesh_2x2(dp: int = 2, tp: int = 2):
    """One (dp, tp) mesh per process and shape, as a training script has: DeviceMesh caches its
    slices by value, so a second init_device_mesh of the same layout would hand out slices
    holding the first one's process groups next to its own."""
    if (dp, tp) not in _MESHES:
        _MESHES[dp, tp] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return _MESHES[dp, tp]


def hybrid_mesh(replicate: int = 2, shard: int = 2, tp: int = 2):
    """One (replicate, shard, tp) mesh per process and shape: hybrid sharding next to TP."""
    key = ("hybrid", replicate, shard, tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", (replicate, shard, tp), mesh_dim_names=("replicate", "shard", "tp"))
    return _MESHES[key]


def _dp_size_rank(dp_mesh) -> tuple[int, int]:
    """A data-parallel mesh's size and this rank's index in it (row-major over a 2-D one)."""
    if dp_mesh.ndim == 1:
        return dp_mesh.size(), dp_mesh.get_local_rank()
    return dp_mesh.size(), dp_mesh.get_local_rank(0) * dp_mesh.size(1) + dp_mesh.get_local_rank(1)


def _data_parallel(layout: str):
    """(the whole mesh, the mesh zerofx is given, data-parallel size, this rank's dp index) of a
    layout: "2x2" is (dp, tp), "2x2x2" hybrid (replicate, shard, tp)."""
    if layout == "2x2":
        mesh = mesh_2x2()
        dp = mesh["dp"]
    else:
        mesh = hybrid_mesh(*(int(n) for n in layout.split("x")))
        dp = mesh["replicate", "shard"]
    return mesh, dp, *_dp_size_rank(dp)


def _local_bytes(model) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def _tp_copy(base: torch.nn.Module, plan: Callable, mesh) -> torch.nn.Module:
    """A copy of ``base`` parallelized on ``mesh["tp"]`` with ``plan`` (base itself stays whole)."""
    return parallelize(copy.deepcopy(base), mesh["tp"], plan(base))


def batches(steps: int, dp: int, vocab: int = 64, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        data = torch.randint(0, vocab, (PER_DP_RANK * dp, seq + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def _mine(t: torch.Tensor, dp_rank: int) -> torch.Tensor:
    return t[dp_rank * PER_DP_RANK : (dp_rank + 1) * PER_DP_RANK]


def _dp_mean(loss: torch.Tensor, dp_mesh) -> float:
    """The mean loss over the data-parallel ranks; over a 2-D (replicate, shard) mesh, the mean
    over all ranks (every TP rank of a data-parallel index holds the same loss)."""
    t = loss.detach().clone()
    if dp_mesh.ndim == 1:
        dist.all_reduce(t, group=dp_mesh.get_group())
        return float(t) / dp_mesh.size()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def parity(
    model: str,
    stage: int,
    steps: int = 3,
    clip: float | None = None,
    layout: str = "2x2",
    seqs: tuple[int, ...] | None = None,
    micro: int = 1,
    **options: Any,
) -> dict:
    """Train zerofx, the oracle and the single process ``steps`` steps; what the tests read.
    ``layout``: "2x2" (dp, tp), or hybrid sharding next to TP, "2x2x2" (replicate, shard, tp).
    ``seqs``: one sequence length per step instead (a recompile with the length as a symbol).
    ``micro``: micro-batches per step, all but the last under ``zerofx.no_sync``."""
    factory, plan, loss_fn = MODELS[model]
    mesh, dp_mesh, dp_size, dp_rank = _data_parallel(layout)
    base = factory()
    single = copy.deepcopy(base)
    replica = _tp_copy(base, plan, mesh)
    ours = _tp_copy(base, plan, mesh)
    # tp_dim= names the TP dimension of the whole mesh, which zerofx is then given
    zerofx.compile(ours, mesh if "tp_dim" in options else dp_mesh, stage=stage, **options)
    exact = "param_dtype" not in options
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    single_opt = torch.optim.AdamW(single.parameters(), lr=LR)
    oracle = ShardedReference(replica, ours, lambda ps: torch.optim.AdamW(ps, lr=LR)) if exact else None
    out: dict[str, Any] = {"losses": [], "single": [], "oracle_equal": [], "divergences": [], "norms": []}
    data = batches(steps, dp_size) if seqs is None else [batches(1, dp_size, seq=n)[0] for n in seqs]
    for step, (x, y) in enumerate(data):
        xm, ym = _mine(x, dp_rank), _mine(y, dp_rank)
        pieces = list(zip(xm.chunk(micro), ym.chunk(micro)))
        loss, equal = torch.zeros(()), True
        for i, (xi, yi) in enumerate(pieces):
            with zerofx.no_sync(ours) if i < len(pieces) - 1 else contextlib.nullcontext():
                part = loss_fn(ours, xi, yi) / micro
                part.backward()
            if oracle is not None:
                ref_loss = oracle.backward(lambda m: loss_fn(m, xi, yi) / micro)  # called at once
                equal &= bool(torch.equal(part.detach().float(), ref_loss.float()))
            loss = part.detach() if micro == 1 else loss + part.detach()
        if oracle is not None:
            out["oracle_equal"].append(equal)
            oracle.reduce_gradients()
            out["divergences"] += [str(d) for d in oracle.check_gradients(ours, step)]
        single_loss = loss_fn(single, x, y)
        single_loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), clip)
            single_norm = torch.nn.utils.clip_grad_norm_(single.parameters(), clip)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            out["norms"].append((float(norm), float(single_norm)))
            if oracle is not None:
                out["divergences"] += [str(d) for d in oracle.clip_grad_norm_(clip, norm, step=step)]
        opt.step()
        opt.zero_grad()
        single_opt.step()
        single_opt.zero_grad()
        if oracle is not None:
            oracle.step()
            out["divergences"] += [str(d) for d in oracle.check_parameters(ours, step)]
        out["losses"].append(_dp_mean(loss.float(), dp_mesh))
        out["single"].append(float(single_loss.detach()))
    out["placements"] = {n: [str(p) for p in t.placements] for n, t in ours.named_parameters()}
    return out


def memory(model: str, stage: int, layout: str = "2x2") -> dict:
    """Per-rank elements of parameters and AdamW state after a step, and what numel says they
    must be: a parameter the TP plan shards holds numel/(dp*tp) per rank, one it replicates numel/dp
    (every size here divides; dp: the shard dimension's size, hybrid sharding replicates across
    the other)."""
    factory, plan, loss_fn = MODELS[model]
    mesh, dp_mesh, dp_size, dp_rank = _data_parallel(layout)
    base = factory()
    ours = _tp_copy(base, plan, mesh)
    tp_sharded = {n for n, p in ours.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()}
    zerofx.compile(ours, dp_mesh, stage=stage)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    x, y = batches(1, dp_size)[0]
    loss_fn(ours, _mine(x, dp_rank), _mine(y, dp_rank)).backward()
    opt.step()
    dp, tp = dp_mesh.size(dp_mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    expected = sum(p.numel() // (dp * tp if n in tp_sharded else dp) for n, p in base.named_parameters())
    params = sum(p.to_local().numel() for p in ours.parameters())
    state = sum(
        v.to_local().numel() for s in opt.state.values() for v in s.values() if isinstance(v, DTensor) and v.dim()
    )
    whole = sum(p.numel() for p in base.parameters())
    return {"params": params, "state": state, "expected": expected, "whole": whole, "tp_sharded": len(tp_sharded)}


class _EagerCollectives(TorchDispatchMode):
    """Bytes of every functional collective run under it (DTensor's redistributions run as
    functional collectives in eager mode too), counted as zerofx counts its own (NOTE: counting
    collective bytes, zerofx/ir/collectives.py): (kind, group name) -> bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.by_group: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar first; its collectives come back here
        out = func(*args, **(kwargs or {}))
        spec = COLLECTIVE_OPS.get(func)
        if spec is not None:
            sized = out if spec.sized == "out" else args[0]
            size = collective_group_size(spec, args)
            key = (spec.kind, args[spec.group_name_arg])
            nbytes = wire_bytes(spec.kind, sized.numel() * sized.element_size(), size)
            self.by_group[key] = self.by_group.get(key, 0) + nbytes
        return out


def collective_bytes(model: str, layout: str = "2x2", **options: Any) -> dict:
    """Bytes per training step per rank on each mesh dimension (zerofx's counter), against the
    formulas: ZeRO-3 on dp moves 3·Ψ_tp·(dp-1)/dp (Ψ_tp: this rank's TP-local parameter bytes;
    forward gather + backward re-gather + gradient reduce-scatter); on tp, exactly the TP
    model's own collectives (the same TP model without zerofx, eager, counted the same way):
    zerofx adds no TP traffic and removes none. With hybrid sharding the dims are "replicate",
    "shard" and "tp"; a group over both data-parallel dims (hpZ's) is "all"."""
    factory, plan, loss_fn = MODELS[model]
    mesh, dp_mesh, dp_size, dp_rank = _data_parallel(layout)
    base = factory()
    replica = _tp_copy(base, plan, mesh)
    ours = _tp_copy(base, plan, mesh)
    psi_tp = _local_bytes(ours)
    zerofx.compile(ours, dp_mesh, **options)
    x, y = batches(1, dp_size)[0]
    xm, ym = _mine(x, dp_rank), _mine(y, dp_rank)
    loss_fn(ours, xm, ym).backward()  # compile outside the count
    with zerofx.CollectiveCounter() as forward:
        loss = loss_fn(ours, xm, ym)
    with zerofx.CollectiveCounter() as backward:
        loss.backward()
    with _EagerCollectives() as eager_forward:
        loss = loss_fn(replica, xm, ym)
    with _EagerCollectives() as eager_backward:
        loss.backward()
    dims = {mesh.get_group(name).group_name: name for name in mesh.mesh_dim_names}

    def per_dim(by_group: dict) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, group), nbytes in by_group.items():
            kinds = out.setdefault(dims.get(group, "all"), {})
            kinds[kind] = kinds.get(kind, 0) + nbytes
        return out

    # the TP model leaves a TP-replicated parameter's gradient Partial (torch's optimizers and
    # clipping then read it so); zerofx's rebuilt DTensor all-reduces it in the backward
    partial = sum(
        p.grad.to_local().numel() * p.grad.element_size()
        for p in replica.parameters()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    )
    share = (dp_mesh.size(dp_mesh.ndim - 1) - 1) / dp_mesh.size(dp_mesh.ndim - 1)
    return {
        "forward": per_dim(forward.by_group),
        "backward": per_dim(backward.by_group),
        "tp_forward": per_dim(eager_forward.by_group),
        "tp_backward": per_dim(eager_backward.by_group),
        "tp_partial_all_reduce": wire_bytes("all_reduce", partial, mesh.size(mesh.ndim - 1)),
        "psi_tp_share": psi_tp * share,  # every parameter trains here
        "psi_tp": psi_tp,
    }


def explain(model: str) -> list[str]:
    """The collective lines of ``zerofx.explain``'s report on the TP model."""
    factory, plan, loss_fn = MODELS[model]
    mesh = mesh_2x2()
    base = factory()
    ours = _tp_copy(base, plan, mesh)
    zerofx.compile(ours, mesh["dp"])
    x, y = batches(1, 2)[0]
    dp_rank = mesh.get_local_rank("dp")

    class Loss(torch.nn.Module):  # explain() calls its model with the example inputs
        def __init__(self):
            super().__init__()
            self.inner = ours

        def forward(self, x, y):
            return loss_fn(self.inner, x, y)

    report = zerofx.explain(Loss(), _mine(x, dp_rank), _mine(y, dp_rank))
    return [line.strip() for line in report.splitlines() if line.strip().startswith(("collective", "input", "gather"))]


def gathered(model: str, layout: str = "2x2") -> dict:
    """Inference inside ``zerofx.gathered`` (each rank's TP share gathered over dp once) against
    the compiled forward: the same logits."""
    factory, plan, loss_fn = MODELS[model]
    mesh, dp_mesh, dp_size, dp_rank = _data_parallel(layout)
    base = factory()
    ours = _tp_copy(base, plan, mesh)
    zerofx.compile(ours, dp_mesh)
    x, _ = batches(1, dp_size)[0]
    x = _mine(x, dp_rank)
    with torch.no_grad():
        compiled = ours(x)
        with zerofx.gathered(ours) as g:
            eager = ours(x)
    compiled = compiled.logits if hasattr(compiled, "logits") else compiled
    eager = eager.logits if hasattr(eager, "logits") else eager
    return {"max_diff": float((compiled - eager).abs().max()), "nbytes": g.nbytes, "shape": list(eager.shape)}


WHOLE_OPTIMIZERS: dict[str, Callable] = {
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "muon": lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2], lr=2e-2),
}


def whole_step(
    model: str, optimizer: str, steps: int = 3, alone_bytes: int | None = None, layout: str = "2x2", **options: Any
) -> dict:
    """An optimizer zerofx steps over whole tensors (zerofx/runtime/whole_step.py) on the TP
    model sharded over dp, against the same optimizer stepping the unsharded model's parameters
    given the zerofx model's global gradients: after each step, which parameters (global
    values) and which state entries differ at all. The step's arithmetic then runs on the same
    global tensors on both sides, so nothing may. ``options``: zerofx.shard's; ``alone_bytes``:
    whole_step.ALONE_BYTES for the run."""
    if alone_bytes is not None:
        return alone(lambda: whole_step(model, optimizer, steps, layout=layout, **options), alone_bytes)
    factory, plan, loss_fn = MODELS[model]
    mesh, dp_mesh, dp_size, dp_rank = _data_parallel(layout)
    base = factory()
    ref = copy.deepcopy(base)
    ours = zerofx.shard(_tp_copy(base, plan, mesh), dp_mesh, **options)
    make = WHOLE_OPTIMIZERS[optimizer]
    opt, ref_opt = make(list(ours.parameters())), make(list(ref.parameters()))
    out: dict[str, Any] = {"params": [], "state": [], "moved": [], "layouts": {}}
    for x, y in batches(steps, dp_size):
        loss_fn(ours, _mine(x, dp_rank), _mine(y, dp_rank)).backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = None if p.grad is None else global_value(p.grad).clone()
        before = [p.to_local().clone() for p in ours.parameters()]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["moved"].append(any(not torch.equal(p.to_local(), b) for p, b in zip(ours.parameters(), before)))
        out["params"].append(
            [n for (n, p), q in zip(ours.named_parameters(), ref.parameters()) if not torch.equal(global_value(p), q)]
        )
        out["state"].append(state_mismatches(opt, ref_opt))
    names = [n for n, _ in ours.named_parameters()]
    out["layouts"] = {
        names[j]: {k: str(v.placements) if isinstance(v, DTensor) else type(v).__name__ for k, v in entry.items()}
        for j, entry in opt.state_dict()["state"].items()
    }
    out["tp_sharded"] = sorted(n for n, p in ours.named_parameters() if p.placements[-1].is_shard())
    out["dp_whole"] = sorted(n for n, p in ours.named_parameters() if p.placements[-2].is_replicate())
    return out


def step_transient(optimizer: str) -> int:
    """What a step after the first allocates above its start at its peak on this rank, as the
    allocator sees it (the least of five steps: a buffer freed on gloo's thread is seen late),
    for an optimizer zerofx steps over whole tensors on the TP GPT sharded over dp."""
    from zerofx.measure.allocations import allocated_above_start

    mesh = mesh_2x2()
    dp_rank = mesh.get_local_rank("dp")
    ours = zerofx.shard(_tp_copy(gpt(), gpt_plan, mesh), mesh["dp"])
    opt = WHOLE_OPTIMIZERS[optimizer](list(ours.parameters()))
    x, y = batches(1, mesh.size(0))[0]
    ours(_mine(x, dp_rank), _mine(y, dp_rank)).backward()
    opt.step()
    seen = []
    for _ in range(5):  # ranks start each step together
        dist.barrier()
        seen.append(allocated_above_start(opt.step))
    return min(seen)


def errors() -> dict:
    """Each bad input, and the first line of the error it raised (or 'no error')."""
    results = {}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            results[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads the message
            results[name] = f"{type(e).__name__}: {e}"

    mesh = mesh_2x2()

    def tp_on_dp():
        model = parallelize(gpt(), mesh["dp"], gpt_plan(gpt()))
        zerofx.compile(model, mesh["dp"])

    def unnamed_3d():
        from torch.distributed.device_mesh import DeviceMesh

        mesh3 = DeviceMesh("cpu", torch.arange(4).view(1, 2, 2))
        model = parallelize(gpt(), mesh["tp"], gpt_plan(gpt()))
        zerofx.compile(model, mesh3)

    def two_meshes():  # another init_device_mesh call, laid out the other way round
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
        model = parallelize(gpt(), other["tp"], gpt_plan(gpt()))
        zerofx.compile(model, mesh["dp"])

    def three_dp_dims():  # hybrid sharding takes two data-parallel dims next to TP, not three
        mesh4 = init_device_mesh("cpu", (1, 1, 2, 2), mesh_dim_names=("a", "b", "c", "tp"))
        model = parallelize(gpt(), mesh4["tp"], gpt_plan(gpt()))
        zerofx.compile(model, mesh4, tp_dim="tp")

    def hpz_without_hybrid():  # hpZ's secondary partition is the inner of two data-parallel dims
        model = parallelize(gpt(), mesh["tp"], gpt_plan(gpt()))
        zerofx.compile(model, mesh, tp_dim="tp", secondary_shard=True)

    def tp_dim_without_plan():
        zerofx.compile(gpt(), mesh, tp_dim="tp")

    def tied_differently():
        model = gpt()
        plan = gpt_plan(model)
        from torch.distributed.tensor.parallel import RowwiseParallel

        plan["lm_head"] = RowwiseParallel()
        parallelize(model, mesh["tp"], plan)

    attempt("tp_on_dp", tp_on_dp)
    attempt("unnamed_3d", unnamed_3d)
    attempt("two_meshes", two_meshes)
    attempt("three_dp_dims", three_dp_dims)
    attempt("hpz_without_hybrid", hpz_without_hybrid)
    attempt("tp_dim_without_plan", tp_dim_without_plan)
    attempt("tied_differently", tied_differently)

    def untied_by_torch():  # torch's parallelize_module gives a tied HF model two parameters there
        from torch.distributed.tensor.parallel import parallelize_module

        model = llama(tied=True)
        parallelize_module(model, mesh["tp"], hf_plan(model))
        zerofx.compile(model, mesh["dp"])

    def tp_after_compile():
        parallelize(zerofx.compile(gpt(), mesh["dp"]), mesh["tp"], gpt_plan(gpt()))

    attempt("untied_by_torch", untied_by_torch)
    attempt("tp_after_compile", tp_after_compile)

    def tp_outer():  # one mesh, tp its outer dimension: DTensor cannot reduce the norm over (dp, tp)
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
        model = parallelize(gpt(), other["tp"], gpt_plan(gpt()))
        zerofx.compile(model, other["dp"])

    attempt("tp_outer", tp_outer)

    def uneven_sequence():  # sequence parallelism over 2 ranks, a sequence of 15: gloo aborted the process
        model = zerofx.compile(parallelize(gpt(), mesh["tp"], gpt_plan(gpt())), mesh["dp"])
        x, y = batches(1, 1, seq=15)[0]
        model(x, y)

    attempt("uneven_sequence", uneven_sequence)
    return results


# --- checkpoints across layouts (DCP) --------------------------------------------------------
# The (2, 2) run's global batch of PER_DP_RANK * 2 sequences is what every layout trains on: each
# data-parallel rank takes its equal slice, so the mean over dp of the per-rank mean losses is
# the global batch's mean loss in every layout.
GLOBAL_BATCH = PER_DP_RANK * 2
# (dp, tp) of each layout a checkpoint loads into; tp=None: a plain 1-D zerofx model, no TP plan;
# dp a pair: hybrid sharding (replicate, shard) next to TP (8 ranks)
LAYOUTS = {"2x2": (2, 2), "dp4": (4, None), "tp4": (1, 4), "2x2x2": ((2, 2), 2), "4x2": (4, 2)}
_FLAT: dict = {}


def _layout(model: str, layout: str, stage: int, seed: int):
    """``model`` (factory seed ``seed``) in ``layout``, zerofx-compiled at ``stage``: (module,
    loss_fn, dp mesh)."""
    factory, plan, loss_fn = MODELS[model]
    dp, tp = LAYOUTS[layout]
    base = factory(seed)
    if tp is None:
        if dp not in _FLAT:
            _FLAT[dp] = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        dp_mesh = _FLAT[dp]
    elif isinstance(dp, tuple):
        mesh = hybrid_mesh(*dp, tp)
        parallelize(base, mesh["tp"], plan(base))
        dp_mesh = mesh["replicate", "shard"]
    elif dist.get_world_size() == 8:  # next to the hybrid mesh, whose "tp" slice DeviceMesh would hand out
        if layout not in _FLAT:  # for this one's (equal by value: the same ranks and name)
            _FLAT[layout] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp_of_4x2"))
        mesh = _FLAT[layout]
        parallelize(base, mesh["tp_of_4x2"], plan(base))
        dp_mesh = mesh["dp"]
    else:
        mesh = mesh_2x2(dp, tp)
        parallelize(base, mesh["tp"], plan(base))
        dp_mesh = mesh["dp"]
    return zerofx.compile(base, dp_mesh, stage=stage), loss_fn, dp_mesh


def _train(model, opt, loss_fn, dp_mesh, steps) -> list[float]:
    """One AdamW step per batch of ``steps`` (each a global batch); the global mean losses."""
    size, rank = _dp_size_rank(dp_mesh)
    per = GLOBAL_BATCH // size
    losses = []
    for x, y in steps:
        loss = loss_fn(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss.float(), dp_mesh))
    return losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor, whole (a collective), by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = _full(p)
        for key, value in opt.state.get(p, {}).items():
            out[f"{name}:{key}"] = _full(value)
    return out


def checkpoint_layouts(
    model: str, folder: str, stage: int = 3, loads: tuple = (("2x2", 3),), saved_in: str = "2x2"
) -> dict:
    """Train 2 steps in layout ``saved_in`` (dp=2, tp=2) at ``stage``, save with zerofx.checkpoint.save, keep each
    parameter and optimizer state tensor whole, then train 2 more steps (the uninterrupted
    losses). Each ``(layout, stage)`` of ``loads`` then builds the model afresh from another
    seed, loads the checkpoint and trains the same 2 steps: what the tests compare."""
    from pathlib import Path

    import zerofx.checkpoint

    vocab = 64
    steps = batches(4, GLOBAL_BATCH // PER_DP_RANK, vocab=vocab)
    path = Path(folder) / f"{model}-stage{stage}"
    ours, loss_fn, dp_mesh = _layout(model, saved_in, stage, seed=0)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    first = _train(ours, opt, loss_fn, dp_mesh, steps[:2])
    zerofx.checkpoint.save(path, ours, opt, extra={"step": 2})
    saved = _full_state(ours, opt)
    out: dict[str, Any] = {"first": first, "uninterrupted": _train(ours, opt, loss_fn, dp_mesh, steps[2:])}
    out["saved"] = sorted(saved)
    torch._dynamo.reset()
    for layout, load_stage in loads:
        model_, loss_fn, dp_mesh = _layout(model, layout, load_stage, seed=1)
        opt = torch.optim.AdamW(model_.parameters(), lr=LR)
        differs_before = sorted(
            k for k, v in _full_state(model_, opt).items() if k in saved and not torch.equal(v, saved[k])
        )
        extra = zerofx.checkpoint.load(path, model_, opt)
        loaded = _full_state(model_, opt)
        out[f"{layout}/stage{load_stage}"] = {
            "extra": extra,
            "keys": sorted(loaded),
            "differs_before": differs_before,
            "differs": sorted(k for k in saved if k not in loaded or not torch.equal(loaded[k], saved[k])),
            "losses": _train(model_, opt, loss_fn, dp_mesh, steps[extra["step"] :]),
        }
        del model_, opt
        torch._dynamo.reset()
    return out


def meta_built(model: str, folder: str | None = None, stage: int = 3, layout: str = "2x2") -> dict:
    """The TP model built under ``torch.device("meta")`` (shapes only), parallelized and compiled
    on the 2x2 mesh (or ``layout``'s), so that no rank ever holds more than its dp rows of its TP
    share (and at stages 1-2 the whole copy of that share zerofx keeps); then
    loaded from a model trained 2 steps on the same layout, three ways: ``zerofx.checkpoint.load``
    (DCP, with the optimizer), ``zerofx.checkpoint.load_hf`` (HF safetensors that
    ``zerofx.checkpoint.export`` wrote) and ``model.load_state_dict`` of whole tensors. What the
    tests compare: bytes held, the refusal before loading, the loaded values against the saved
    ones, and the losses of the next 2 steps against the uninterrupted run's."""
    from pathlib import Path

    import zerofx.checkpoint
    from zerofx.measure.allocations import AllocationTrace
    from zerofx.runtime.params import runtime_of

    factory, plan, loss_fn = MODELS[model]
    mesh, dp_mesh, dp_size, dp_rank = _data_parallel(layout)
    steps = batches(4, dp_size)

    def train(m, opt, batch) -> list[float]:
        losses = []
        for x, y in batch:
            loss = loss_fn(m, _mine(x, dp_rank), _mine(y, dp_rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_dp_mean(loss, dp_mesh))
        return losses

    made = folder is None
    if made:  # one fresh folder, named by rank 0, removed at the end
        import tempfile

        named = [tempfile.mkdtemp(prefix="zerofx-meta-tp-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(named, src=0)
        folder = named[0]
    source = factory(0)
    parallelize(source, mesh["tp"], plan(source))
    zerofx.compile(source, dp_mesh, stage=stage)
    opt = torch.optim.AdamW(source.parameters(), lr=LR)
    train(source, opt, steps[:2])
    path = Path(folder) / f"meta-{model}-stage{stage}-{layout}"
    zerofx.checkpoint.save(path, source, opt, extra={"step": 2})
    hf = Path(folder) / f"meta-{model}-stage{stage}-{layout}-hf"
    if dist.get_rank() == 0:
        zerofx.checkpoint.export(path, hf)
    dist.barrier()
    saved = _full_state(source, opt)
    whole = {k: v for k, v in saved.items() if ":" not in k}
    out: dict[str, Any] = {"source_bytes": _local_bytes(source), "uninterrupted": train(source, opt, steps[2:])}
    out["whole_bytes"] = sum(p.numel() * p.element_size() for p in factory(0).parameters())
    for how in ("dcp", "hf", "whole"):
        with AllocationTrace() as trace:
            t0 = trace.mark()
            with torch.device("meta"):
                built = factory(1)
            parallelize(built, mesh["tp"], plan(built))
            zerofx.compile(built, dp_mesh, stage=stage)
            t1 = trace.mark()
        copies = {id(s.full): s.full for s in runtime_of(built).states if s.full is not None}
        got: dict[str, Any] = {
            "bytes": _local_bytes(built),
            "whole_copies": sum(t.numel() * t.element_size() for t in copies.values()),
            "build_peak": trace.peak_between(t0, t1) - trace.live_at(t0),
        }
        try:
            loss_fn(built, _mine(steps[2][0], dp_rank), _mine(steps[2][1], dp_rank))
            got["refused"] = None
        except zerofx.ZeroFXError as e:
            got["refused"] = str(e)
        opt = torch.optim.AdamW(built.parameters(), lr=LR)
        if how == "dcp":
            zerofx.checkpoint.load(path, built, opt)
        elif how == "hf":
            zerofx.checkpoint.load_hf(hf, built)
        else:
            built.load_state_dict(whole, strict=False)
            non_persistent = [
                f"{p}.{n}" if p else n for p, m in built.named_modules() for n in m._non_persistent_buffers_set
            ]
            for name in non_persistent:  # what no state dict holds: the user sets it (the rotary inv_freq)
                built.get_buffer(name).copy_(source.get_buffer(name))
            zerofx.sharding.mark_loaded(built, non_persistent)
        loaded = _full_state(built, opt)
        checked = saved if how == "dcp" else whole
        got["differs"] = sorted(k for k in checked if not torch.equal(loaded[k], checked[k]))
        got["losses"] = train(built, opt, steps[2:])
        out[how] = got
        del built, opt
        torch._dynamo.reset()
    dist.barrier()
    if made and dist.get_rank() == 0:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return out


def heads_not_divisible() -> str:
    """The test Llama (2 KV heads) parallelized over 4 TP ranks: the error it raised."""
    try:
        parallelize(llama(), mesh_2x2(1, 4)["tp"], hf_plan(llama()))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def run(rank: int, world: int, calls: list[tuple[str, dict]]) -> dict:
    """Run each ``(scenario name, kwargs)`` on this rank; a failure is recorded, not raised, so
    the other scenarios still run (every rank fails the same way: they run the same code)."""
    out = {}
    for i, (name, kwargs) in enumerate(calls):
        started = time.perf_counter()
        try:
            out[i] = {"ok": globals()[name](**kwargs)}
        except Exception:  # noqa: BLE001 - reported to the test
            out[i] = {"error": traceback.format_exc()}
        torch._dynamo.reset()
        out[i]["seconds"] = time.perf_counter() - started  # what the scenario costs the suite
    return out


def ragged_share(model: str = "linear", layout: str = "2x2x2") -> str:
    """hpZ over the 2x2x2 mesh's (replicate, shard) dimensions, flattened to 4 data-parallel ranks,
    next to a column-parallel Linear(16, 97): DTensor's strided layout and zerofx's split of the TP
    shares (49 and 48 rows over 4 ranks) disagree at some coordinates only. What this rank raised:
    every rank must raise, or the others wait in the next collective."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = hybrid_mesh()
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(16, 97))
    parallelize(linear, mesh["tp"], {"0": ColwiseParallel()})
    try:
        zerofx.compile(linear, mesh["replicate", "shard"], secondary_shard=True)
        return "no error"
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"


def hf_lengths(rank: int, world: int) -> dict:
    """An HF Llama, tensor-parallel over 2 ranks, trained on sequences of 16 then 12 under
    zerofx.compile's default dynamic shapes, then with dynamic=False: what each raised, and the
    second run's losses."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    got = {}
    for dynamic in ("auto", False):
        torch._dynamo.reset()
        model = llama()
        parallelize(model, mesh["tp"], hf_plan(model))
        model = zerofx.compile(model, mesh, tp_dim="tp", dynamic=dynamic)
        losses = []
        try:
            for seq in (16, 12):
                x, y = batches(1, 1, seq=seq)[0]
                loss = model(input_ids=x, labels=y).loss
                loss.backward()
                losses.append(loss.item())
            got[str(dynamic)] = losses
        except Exception as e:  # noqa: BLE001 - the test reads the message
            got[str(dynamic)] = f"{type(e).__name__}: {e}"
    return got


class _BreakBetweenTP(torch.nn.Module):
    """A column-parallel Linear whose DTensor output crosses a graph break into a row-parallel one."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 12)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.relu(h))


def dtensor_frame_outputs(rank: int, world: int) -> dict:
    """Frames whose outputs are DTensors (an activation crossing a graph break; logits under
    loss_parallel), whose gradients are DTensors too: the loss and the gradients of a plain
    twin, per rank, on a (1, world) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel

    import zerofx
    from zerofx.tensor_parallel import parallelize

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 3, 7, 11])
    out = {}
    for case in ("graph_break", "loss_parallel"):
        torch.manual_seed(0)
        if case == "graph_break":
            build = _BreakBetweenTP
            plan = {"a": ColwiseParallel(use_local_output=False), "b": RowwiseParallel(input_layouts=Shard(-1))}
        else:  # logits left sharded over the classes
            build = lambda: torch.nn.Sequential(  # noqa: E731
                torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 12)
            )
            plan = {
                "0": ColwiseParallel(),
                "2": RowwiseParallel(),
                "3": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            }
        model, twin = build(), build()
        twin.load_state_dict(model.state_dict())
        parallelize(model, mesh["tp"], plan)
        model = zerofx.compile(model, mesh["dp"])
        with loss_parallel() if case == "loss_parallel" else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        want = torch.nn.functional.cross_entropy(twin(x), y)
        want.backward()
        got = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        worst = max(
            (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), twin.parameters())
        )
        out[case] = (got.item(), want.item(), worst)
        torch._dynamo.reset()
    return out
