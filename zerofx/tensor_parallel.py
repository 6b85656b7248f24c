"""Tensor-parallel plans for the models zerofx trains, and ``parallelize``: torch's
``parallelize_module`` that keeps tied parameters tied.

ZeRO composes with tensor parallelism on a 2-D ``(dp, tp)`` mesh: the model is parallelized
with torch's own tensor parallelism on ``mesh["tp"]`` (DTensor, ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel``), then ``zerofx.compile(model, mesh["dp"])`` shards
each parameter's TP-local value over the data-parallel dimension (zerofx/sharding.py, NOTE:
ZeRO with tensor parallelism)::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"], gpt_plan(model))        # or hf_plan(hf_model)
    model = zerofx.compile(model, mesh["dp"])

Nothing here is needed for that composition: any plan ``parallelize_module`` takes works. What
this module adds:

* ``gpt_plan``: Megatron-style tensor parallelism for ``zerofx.models.GPT`` (column-wise qkv and
  MLP input, row-wise attention output and MLP output), with sequence parallelism (norms and
  the residual stream sharded along the sequence) by default: what torchtitan does for Llama;
* ``hf_plan``: an HF transformers model's own plan (``model._tp_plan``, the ``colwise`` /
  ``rowwise`` strings its config declares for ``from_pretrained(tp_plan="auto")``) as torch
  parallel styles, so an HF model built from a config parallelizes without HF's loader;
* ``parallelize``: ``parallelize_module`` replaces each planned module's parameters with new
  DTensors, so a parameter two modules share (tied input and output embeddings) silently
  becomes two independent ones, each trained by half the gradient. ``parallelize`` ties them
  again when both sides got the same placements, and refuses a plan that would shard them
  differently.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from zerofx.errors import ZeroFXError
from zerofx.options import closest

__all__ = ["gpt_plan", "llama_plan", "hf_plan", "plan_for", "parallelize"]


def gpt_plan(model: nn.Module, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Tensor parallelism for ``zerofx.models.GPT`` on a TP mesh of any size dividing its heads.

    Attention: qkv column-wise (each rank whole heads: the GPT's qkv rows are head-major), the
    output projection row-wise; MLP: ``fc`` column-wise, ``out`` row-wise; the token embedding
    row-wise (vocabulary rows), the tied ``lm_head`` column-wise over the same rows, its logits
    gathered. With ``sequence_parallel`` the residual stream between blocks is sharded along
    the sequence (dim 1): layer norms run on each rank's positions (``SequenceParallel``), the
    attention and MLP inputs are all-gathered and their outputs reduce-scattered; without it
    the residual stream is replicated and the norms stay plain parameters."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # positions are (seq, d_model): the sequence is dim 0 there
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    block: dict[str, Callable[[], ParallelStyle]] = {
        "attn.qkv": ColwiseParallel,
        "attn.proj": lambda: RowwiseParallel(output_layouts=seq),
        "fc": lambda: ColwiseParallel(input_layouts=seq),
        "out": lambda: RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        block.update(
            {
                "ln1": SequenceParallel,
                "attn": lambda: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "ln2": SequenceParallel,
            }
        )
    return plan | _every_block(model, block)


def llama_plan(model: nn.Module, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """Tensor parallelism for ``zerofx.models.Llama`` (dense MLPs; the shapes ``zerofx plan``
    builds for Llama 3): q and kv column-wise (whole heads per rank: kv's rows are head-major;
    the TP size must divide the KV heads), o row-wise; the SwiGLU's fused gate/up column-wise
    (its rows interleave gate and up), down row-wise; embedding row-wise, ``lm_head`` column-wise
    with its logits gathered. ``sequence_parallel``: as in ``gpt_plan`` (RMSNorms on each rank's
    positions)."""
    if any(getattr(block.mlp, "n_experts", 0) for block in model.blocks):
        raise ZeroFXError("llama_plan: mixture-of-experts MLPs have no tensor-parallel plan here (expert parallelism)")
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    block: dict[str, Callable[[], ParallelStyle]] = {
        "attn.q": ColwiseParallel,
        "attn.kv": ColwiseParallel,
        "attn.o": lambda: RowwiseParallel(output_layouts=seq),
        "mlp.gate_up": ColwiseParallel,
        "mlp.down": lambda: RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        gathered = (Replicate(), None, None)  # (x, cos, sin): the rotary tables are plain tensors
        block.update(
            {
                "attn_norm": SequenceParallel,
                "attn": lambda: PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=gathered),
                "mlp_norm": SequenceParallel,
                "mlp": lambda: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            }
        )
    return plan | _every_block(model, block)


def _every_block(model: nn.Module, block: dict[str, Callable[[], ParallelStyle]]) -> dict[str, ParallelStyle]:
    """``block``'s styles for each of ``model.blocks`` (a fresh style object per module:
    ``parallelize_module`` may keep state on them)."""
    return {f"blocks.{i}.{name}": make() for i in range(len(model.blocks)) for name, make in block.items()}


def plan_for(model: nn.Module) -> dict[str, ParallelStyle]:
    """The plan of this module for ``model``: ``gpt_plan`` / ``llama_plan`` for zerofx's own
    models, ``hf_plan`` for an HF transformers model that declares one."""
    from zerofx.models import GPT, Llama

    if isinstance(model, GPT):
        return gpt_plan(model)
    if isinstance(model, Llama):
        return llama_plan(model)
    if getattr(model, "_tp_plan", None):
        return hf_plan(model)
    raise ZeroFXError(
        f"no tensor-parallel plan for {type(model).__name__}: zerofx.tensor_parallel knows zerofx's GPT and Llama "
        "and HF models that declare base_model_tp_plan; pass a plan for parallelize"
    )


# HF transformers' plan strings (``config.base_model_tp_plan``, ``model._tp_plan``) -> torch styles
_HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(),
}


def hf_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """An HF transformers model's own tensor-parallel plan (``model._tp_plan``) as torch styles
    for ``parallelize_module``: ``colwise`` -> ``ColwiseParallel``, ``rowwise`` ->
    ``RowwiseParallel``, the embedding's and ``lm_head``'s variants with replicated inputs or
    gathered outputs. Module paths keep HF's ``*`` wildcards (``parallelize_module`` matches
    them). A style this table does not know (HF's sequence-parallel and packed variants) is an
    error naming it: HF's own modules shape their sequence from the embedding's output, which a
    sequence-sharded residual stream would change."""
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        raise ZeroFXError(
            f"{type(model).__name__} has no tensor-parallel plan (model._tp_plan is empty): write one for "
            "parallelize_module, or use a model whose config declares base_model_tp_plan"
        )
    unknown = {style for style in plan.values() if style not in _HF_STYLES}
    if unknown:
        raise ZeroFXError(
            f"{type(model).__name__}'s tensor-parallel plan uses {sorted(unknown)}, which zerofx.tensor_parallel "
            f"does not translate (it knows {sorted(_HF_STYLES)}); write the plan for parallelize yourself"
        )
    # a config's plan names every variant's modules (an MoE router a dense variant lacks): the
    # keys this model has no module for are left out, as torch and transformers skip them
    absent = [path for path in plan if _unresolved(model, path) is not None]
    if absent:
        warnings.warn(
            f"zerofx.tensor_parallel.hf_plan: {type(model).__name__}'s plan names modules this model does not have "
            f"({', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''}); those keys are left out",
            stacklevel=2,
        )
    return {path: _HF_STYLES[style]() for path, style in plan.items() if path not in absent}


def _check_heads(model: nn.Module, tp: int, plan: dict[str, Any]) -> None:
    """Column-wise attention projections give each TP rank ``heads / tp`` whole heads (HF's
    plans and ``gpt_plan`` alike), so ``tp`` must divide the query and the key/value heads:
    otherwise the first forward's reshape into heads fails deep inside the model. Checked when
    the plan has a column-wise style on a module path naming attention."""
    if not any(isinstance(style, ColwiseParallel) and "attn" in path for path, style in plan.items()):
        return
    config = getattr(model, "config", None)  # HF
    counts = {f"config.{a}": getattr(config, a, None) for a in ("num_attention_heads", "num_key_value_heads")}
    cfg = getattr(model, "cfg", None)  # zerofx.models.GPT
    counts.update({f"cfg.{a}": getattr(cfg, a, None) for a in ("n_head", "n_kv_head")})
    for name, n in counts.items():
        if isinstance(n, int) and n > 0 and n % tp:
            raise ZeroFXError(
                f"{type(model).__name__}: {name}={n} is not divisible by the tensor-parallel size {tp}: the "
                f"plan's column-wise attention projections would split a head across ranks; use a TP size "
                f"dividing {n}"
            )


def _unresolved(model: nn.Module, key: str) -> str | None:
    """Why plan ``key`` names no submodule of ``model`` (``parallelize_module`` matches each
    dot-separated token with fnmatch), or None when it names some."""
    frontier = [("", model)]
    for token in key.split(".") if key else ():
        matched = [
            (f"{path}.{name}" if path else name, child)
            for path, module in frontier
            for name, child in module.named_children()
            if fnmatch(name, token)
        ]
        if not matched:
            there = sorted({name for _, module in frontier for name, _ in module.named_children()})
            where = ", ".join(sorted({path or "the model" for path, _ in frontier})[:3])
            return (
                f"no submodule of {where} matches {token!r}{closest(token, there)} "
                f"(its submodules: {', '.join(there[:12]) or 'none'})"
            )
        frontier = matched
    return None


def _check_plan_keys(model: nn.Module, plan: dict[str, Any]) -> None:
    """Every key of ``plan`` names at least one submodule. torch only warns about a key that
    resolves to nothing and skips it, and the first forward then fails deep in the compiler on a
    matmul of a DTensor with a plain tensor; a misspelled key is always a wrong plan, so it is an
    error naming it. (``hf_plan`` drops the keys of its model's optional modules itself.)"""
    for key in plan:
        why = _unresolved(model, key)
        if why is not None:
            raise ZeroFXError(f"tensor-parallel plan key {key!r}: {why}")


def _planned_modules(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """The submodules plan ``key`` names (``parallelize_module``'s fnmatch of each token)."""
    tokens = key.split(".")
    return [
        (name, module)
        for name, module in model.named_modules()
        if name and len(name.split(".")) == len(tokens) and all(fnmatch(n, k) for n, k in zip(name.split("."), tokens))
    ]


def _check_even_widths(model: nn.Module, tp: int, plan: dict[str, Any]) -> None:
    """A column-wise layer whose output the plan keeps split along its last dim and hands on as
    a plain local tensor (``ColwiseParallel()``'s default: ``Shard(-1)``, ``use_local_output``)
    needs a width the TP size divides: the next layer's style rebuilds its input from the local
    pieces as if the split were even, so an uneven width (7 over 2 ranks: pieces of 4 and 3)
    failed at the first forward, inside dynamo, on a matmul's "same reduction dim", naming
    neither the plan nor the module (torch's eager TP fails the same way). Checked on
    ``nn.Linear`` and ``nn.Embedding``. Outputs kept as DTensors (``use_local_output=False``:
    DTensor tracks uneven pieces), gathered ones and splits along another dim are left alone
    (the last are checked at run time, ``_check_even_activation_splits``)."""
    widths = {nn.Linear: "out_features", nn.Embedding: "embedding_dim"}
    for key, style in plan.items():
        outputs = getattr(style, "output_layouts", ()) or ()
        if not (
            isinstance(style, ColwiseParallel)
            and getattr(style, "use_local_output", False)
            and any(isinstance(p, Shard) and p.dim == -1 for p in outputs)
        ):
            continue
        for name, module in _planned_modules(model, key):
            attr = next((a for cls, a in widths.items() if isinstance(module, cls)), None)
            width = getattr(module, attr, None) if attr else None
            if isinstance(width, int) and width % tp:
                raise ZeroFXError(
                    f"tensor-parallel plan key {key!r} ({type(style).__name__}): {name}'s output width "
                    f"({attr}={width}) is not divisible by the tensor-parallel size {tp}; its local pieces "
                    f"(uneven) would be taken as an even split by the next layer. Use a width that is a "
                    f"multiple of {tp}, a TP size dividing {width}, or keep the output a DTensor "
                    "(use_local_output=False)"
                )


def _check_even_activation_splits(model: nn.Module, tp: int, plan: dict[str, Any]) -> None:
    """A forward pre-hook on every planned module whose output the plan shards along a dim other
    than the last (sequence parallelism: the embeddings' ``Shard(1)`` output, the row-wise
    layers' reduce-scatter), refusing an input whose size there the TP size does not divide.

    torch's styles rebuild such outputs from the local pieces as if the split were even: with a
    sequence of 15 over 2 ranks one rank's collective expects 8 rows and the other sends 7, and
    gloo aborts the process ("op.preamble.length <= op.nbytes"; NCCL may hang). The output's
    dims before the last are its input's (an embedding's index dims, a linear layer's leading
    dims), so the check reads the first tensor input."""
    checks: dict[str, int] = {}
    for key, style in plan.items():
        layouts = getattr(style, "output_layouts", None) or ()
        dims = [p.dim for p in layouts if isinstance(p, Shard)]
        if not dims or dims[0] == -1:  # the last dim (a column split): no activation is split unevenly
            continue
        for name, _ in _planned_modules(model, key):
            checks[name] = dims[0]
    for name, module in model.named_modules():
        if name in checks:
            module.register_forward_pre_hook(_even_split_hook(name, checks[name], tp))


def _even_split_hook(name: str, dim: int, tp: int) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None:  # (a DTensor, after the style's own input hook: its global shape is read)
            return
        out_dims = x.dim() + (1 if isinstance(module, nn.Embedding) else 0)  # an embedding's output: one dim more
        d = dim if dim >= 0 else dim + out_dims
        if d == out_dims - 1:  # the output's last dim, written as a positive index: a column split
            return
        if 0 <= d < x.dim() and x.shape[d] % tp != 0:
            raise ZeroFXError(
                f"{name}: the tensor-parallel plan shards this module's output along dim {dim} over {tp} ranks "
                f"(sequence parallelism), and its input's size there is {x.shape[d]}, which {tp} does not divide: "
                f"torch's styles assume an even split (uneven pieces abort or hang the collective). Pad the "
                f"sequence to a multiple of {tp}, or build the plan with sequence_parallel=False"
            )

    return hook


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, Any]) -> nn.Module:
    """``parallelize_module(model, tp_mesh, plan)``, keeping tied parameters tied and frozen
    parameters frozen, after checking that every plan key names a submodule and that the TP size
    divides the attention heads (see the module docstring). Returns ``model``.

    Frozen parameters: torch's ``SequenceParallel`` re-creates the norm layers' parameters as
    replicated DTensors without their ``requires_grad`` (the column- and row-wise styles keep
    it), so a frozen norm would train; each parameter's flag is put back by qualified name."""
    if any(getattr(m, "_zerofx", None) is not None for m in model.modules()):
        raise ZeroFXError(
            "zerofx.tensor_parallel.parallelize: the model is sharded by zerofx already; parallelize it first, "
            "then zerofx.compile(model, mesh, tp_dim=...) (docs/tensor_parallel.md)"
        )
    _check_plan_keys(model, plan)
    _check_heads(model, tp_mesh.size(), plan)
    _check_even_widths(model, tp_mesh.size(), plan)
    tied: list[list[tuple[nn.Module, str, str]]] = []  # per shared parameter: (module, attribute, qualified name)
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    trainable: list[tuple[nn.Module, str, bool]] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                qualname = f"{module_name}.{name}" if module_name else name
                owners.setdefault(id(p), []).append((module, name, qualname))
                trainable.append((module, name, p.requires_grad))
    tied = [users for users in owners.values() if len({q for _, _, q in users}) > 1]
    parallelize_module(model, tp_mesh, plan)
    _check_even_activation_splits(model, tp_mesh.size(), plan)
    for module, name, requires_grad in trainable:
        p = module._parameters.get(name)
        if p is not None and p.requires_grad != requires_grad:
            p.requires_grad_(requires_grad)
    for users in tied:
        first_module, first_name, first_qualname = users[0]
        shared = first_module._parameters[first_name]
        for module, name, qualname in users[1:]:
            other = module._parameters[name]
            if other is shared:
                continue
            placements = (
                tuple(p.placements) if isinstance(p, DTensor) else ("not a DTensor",) for p in (shared, other)
            )
            mine, theirs = placements
            if mine != theirs:
                raise ZeroFXError(
                    f"{first_qualname} and {qualname} are one (tied) parameter, but the plan lays them out as "
                    f"{mine} and {theirs}: give both modules styles that shard the shared weight the same way "
                    "(e.g. a row-wise embedding and a column-wise output layer), or untie them first"
                )
            module._parameters[name] = shared
    return model
