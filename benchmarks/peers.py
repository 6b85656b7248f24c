"""Side-by-side training-step benchmark: zerofx against DDP, FSDP2 (eager and compiled), and a
single process, on one model, one data stream and one world size per run; DeepSpeed's ZeRO-3
too with ``--methods ... deepspeed`` (the optional ``deepspeed`` extra; skipped, saying so, when
it is not importable).

    python benchmarks/peers.py --world-sizes 2 4 --json results.json --markdown results.md --plot results.png

Every method trains the same GPT (zerofx/models.py) from the same seed on the same token
batches (each rank its slice of the global batch; the single process the whole batch), with
AdamW. Per method and rank it measures:

* median step time (forward + backward + optimizer step) over ``--steps`` steps after warm-up.
  Every method is built and warmed up first; then the timed steps of all methods run
  interleaved (one step of each in turn, ranks starting each step together), so a shared
  machine's load drifting over the run falls on every method alike;
* compile time: the first step's time minus the median;
* peak memory: the most bytes alive during a steady-state step, counted by the allocator from
  before the model was built (zerofx.measure.allocations.AllocationTrace), so model state, optimizer
  state, communication buffers and activations are all in. At the step's start only what the
  rank holds between steps counts (what existed once the model was built, and the storages of
  its parameters, gradients and optimizer state; DDP runs with ``gradient_as_bucket_view`` so
  its buckets are among them): the rest of the trace's ledger there is buffers a collective
  backend's thread freed unseen in earlier steps (AllocationTrace.step_peak). The least of
  three traced steps (an unseen free can still over-count, never under-count);
* model-state bytes: parameters + gradients + optimizer state held by the rank;
* collective bytes per step per rank (zerofx.ir.collectives NOTE: counting collective bytes): counted
  for zerofx and FSDP2 eager; DDP's come from its C++ reducer, which no Python hook sees, so
  they are the analytical 2·Ψ·(N-1)/N; compiled FSDP2 runs the same collectives as eager.

Ratios are to FSDP2 eager of the same run. Compare within one run only: ranks share the
machine's cores, so absolute times move with load and world size. Ratios also move between
launches of the same setup (fresh processes: thread placement, memory layout); with
``--launches K`` each world size runs K times and the table gives the median ratio and its range.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script (python benchmarks/x.py): this checkout's `benchmarks`, and its
    # zerofx whole (passes/ and codegen/ install into it: the bare source tree lacks them; benchmarks/_checkout.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._checkout import import_checkout

    import_checkout()

from benchmarks._launch import launch_local, positive_int, small_hf_llama  # noqa: E402

SIZES = {
    "small": dict(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=128),
    "medium": dict(vocab_size=1024, seq_len=128, n_layer=6, n_head=8, d_model=256),
    # medium's depth with almost no arithmetic: what a step costs besides compute (Python,
    # dispatch, collective latency), which is what a GPU's fast matmuls leave exposed
    "tiny": dict(vocab_size=64, seq_len=8, n_layer=6, n_head=2, d_model=32),
    # many narrow blocks: what grows with depth (compile time: benchmarks/compile_time.py)
    "deep": dict(vocab_size=1024, seq_len=128, n_layer=48, n_head=2, d_model=64),
}
# the same shapes as an HF LlamaForCausalLM from a config (the hf extra): "llama-small", "llama-medium"
SIZES.update({f"llama-{name}": shape for name, shape in list(SIZES.items())})


class HFCausalLM(torch.nn.Module):
    """An HF ``LlamaForCausalLM`` built from a config with the GPT's shapes (4 KV heads per 8
    query heads, an MLP of 8/3 the width, untied embeddings, SDPA), called as the GPT is:
    ``model(x, y)`` is the mean next-token loss; ``blocks`` are its decoder layers (what FSDP2
    wraps one by one), ``cfg`` the GPT-style shape (DeepSpeed's bucket size reads it)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.lm = small_hf_llama(
            cfg.n_layer,
            cfg.seq_len,
            vocab=cfg.vocab_size,
            hidden=cfg.d_model,
            intermediate=8 * cfg.d_model // 3,
            heads=cfg.n_head,
            kv_heads=max(1, cfg.n_head // 2),
        )
        self.blocks = self.lm.model.layers

    def forward(self, x, y):
        logits = self.lm(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


METHODS = ("ddp", "fsdp2", "fsdp2_compile", "zerofx", "zerofx_inductor", "zerofx_tuned")
# only with --methods: ZeRO-2 / ZeRO-1 layouts; ZeRO++ quantized all-gathers (qwZ), reductions (qgZ), both;
# DeepSpeed's ZeRO-3 (the `deepspeed` extra: pip install 'zerofx[deepspeed]'; skipped when not importable)
OPTIONAL_METHODS = ("zerofx_stage2", "zerofx_stage1", "zerofx_qwz", "zerofx_qgz", "zerofx_zeropp", "deepspeed")
ZEROPP = {
    "zerofx_qwz": dict(quantize_weights="int8"),
    "zerofx_qgz": dict(quantize_grads="int8"),
    "zerofx_zeropp": dict(quantize_weights="int8", quantize_grads="int8"),
}
MEMORY_STEPS = 3


@dataclass(frozen=True)
class Setup:
    size: str
    batch: int  # sequences per rank
    steps: int
    warmup: int
    methods: tuple[str, ...]


def _batches(cfg, setup: Setup, world: int, count: int):
    gen = torch.Generator().manual_seed(1234)
    for _ in range(count):
        data = torch.randint(0, cfg.vocab_size, (setup.batch * world, cfg.seq_len + 1), generator=gen)
        yield data[:, :-1], data[:, 1:]


class _C10dCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of eager c10d collectives (FSDP2 eager issues them through the dispatcher)."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.bytes = world, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from zerofx.ir.collectives import wire_bytes

        name = str(func)
        share = lambda t: t.numel() * t.element_size()  # noqa: E731
        if "_allgather_base" in name or "allgather_into_tensor_coalesced" in name:
            out = args[0] if isinstance(args[0], torch.Tensor) else sum(share(t) for t in args[0])
            self.bytes += wire_bytes("all_gather", share(out) if isinstance(out, torch.Tensor) else out, self.world)
        elif "_reduce_scatter_base" in name or "reduce_scatter_tensor_coalesced" in name:
            inp = args[1] if isinstance(args[1], torch.Tensor) else None
            self.bytes += wire_bytes("reduce_scatter", share(inp) if inp is not None else 0, self.world)
        elif "allreduce" in name:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.bytes += wire_bytes("all_reduce", sum(share(t) for t in tensors), self.world)
        return func(*args, **(kwargs or {}))


def _build(method: str, cfg, mesh, size: str = "small"):
    import zerofx
    from zerofx.models import GPT

    torch.manual_seed(0)
    model = HFCausalLM(cfg) if size.startswith("llama-") else GPT(cfg)
    if method in ("single", "deepspeed"):  # DeepSpeed wraps the model with its optimizer (_deepspeed)
        return model
    if method == "ddp":
        # gradients as views of the buckets: DDP's leaner setting, and it shows the buckets (which
        # DDP rebuilds in its second step) to the peak-memory measure through the gradients
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if method.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return torch.compile(model) if method == "fsdp2_compile" else model
    if method == "zerofx":
        return zerofx.compile(model, mesh)
    if method.startswith("zerofx:"):
        return zerofx.compile(model, mesh, **method_options(method))
    if method in ("zerofx_stage2", "zerofx_stage1"):
        return zerofx.compile(model, mesh, stage=int(method[-1]))
    if method in ZEROPP:
        return zerofx.compile(model, mesh, **ZEROPP[method])
    if method == "zerofx_inductor":
        # Inductor's generated code (fused pointwise kernels) instead of op-by-op ATen
        return zerofx.compile(model, mesh, executor="inductor")
    if method == "zerofx_tuned":
        psi = sum(p.numel() * p.element_size() for p in model.parameters())
        # zerofx_inductor plus selective unsharding of up to half the model (its backward
        # re-gather skipped): faster again, more memory
        return zerofx.compile(model, mesh, executor="inductor", keep_gathered_bytes=psi // 2)
    raise ValueError(method)


def method_options(method: str) -> dict:
    """``zerofx:KEY=VALUE;KEY=VALUE`` -> zerofx.compile's keywords (values are Python literals:
    ``"zerofx:disable_passes=('bucket',);bucket_bytes=0"``): any option set as a method of its own."""
    import ast

    options = {}
    for item in method.split(":", 1)[1].split(";"):
        if item.strip():
            key, value = item.split("=", 1)
            options[key.strip()] = ast.literal_eval(value.strip())
    return options


def _method(name: str) -> str:
    if name in METHODS + OPTIONAL_METHODS or name.startswith("zerofx:"):
        return name
    raise argparse.ArgumentTypeError(
        f"unknown method {name!r}: one of {METHODS + OPTIONAL_METHODS}, or zerofx:KEY=VALUE;..."
    )


def _deepspeed(model, opt, batch: int):
    """DeepSpeed ZeRO-3 over ``model`` with the same torch AdamW as every other method, on the
    CPU accelerator (``DS_ACCELERATOR=cpu``, set by ``run``) and the gloo group this rank
    already joined; fp32, no loss scaling, no clipping. Returns the engine, which is also the
    "optimizer" the step calls (``engine.step()`` / ``engine.zero_grad()``).

    Two defaults are changed so the row measures the same layout as the others: DeepSpeed keeps
    parameters under 1e5 elements whole (``stage3_param_persistence_threshold``: here nearly
    every matrix of the small GPT), set to 0 as zerofx's and FSDP2's; and its reduce bucket
    of 5e8 elements is a 2 GB buffer on every rank, so both buckets hold one transformer block
    (12·d_model² elements), the unit zerofx's "auto" buckets and FSDP2's wrapping use."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the initialized torch.distributed group
    block = 12 * model.cfg.d_model**2
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": block,
            "stage3_prefetch_bucket_size": block,
        },
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as the other methods step
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, engine


def _is_deepspeed(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def _backward(model, loss) -> None:
    """``loss.backward()``; DeepSpeed's engine runs its own (its ZeRO-3 gradient epilogue)."""
    if _is_deepspeed(model):
        model.backward(loss)
    else:
        loss.backward()


def _deepspeed_storages(engine) -> dict[int, int]:
    """Storage address -> bytes of what DeepSpeed's ZeRO-3 keeps between steps on this rank:
    each parameter's partition (``ds_tensor``, in its flat group buffer), the fp32 partitions
    the optimizer steps, their gradient buffer and AdamW's state (by storage, so a view of a
    flat buffer counts once)."""
    zero = engine.optimizer
    tensors = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    tensors += list(getattr(zero, "fp16_partitioned_groups_flat", []) or [])
    tensors += list(getattr(zero, "fp32_partitioned_groups_flat", []) or [])
    if getattr(zero, "grad_partitions_flat_buffer", None) is not None:
        tensors.append(zero.grad_partitions_flat_buffer)
    for state in zero.optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return storages


def _state_bytes(model, opt) -> int:
    from zerofx.measure.model_state import model_state_bytes

    if _is_deepspeed(model):
        return sum(_deepspeed_storages(model).values())
    return model_state_bytes(model, opt).total


def _state_addresses(model, opt) -> set[int]:
    from zerofx.measure.model_state import model_state_addresses

    return set(_deepspeed_storages(model)) if _is_deepspeed(model) else model_state_addresses(model, opt)


@dataclass
class Prepared:
    """One method's model and optimizer after warm-up, with what its measured steps showed."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    batches: list
    mine: slice
    stats: dict
    times: list


def _step(model, opt, x, y) -> None:
    _backward(model, model(x, y))
    opt.step()
    opt.zero_grad()


def _held_step(model, opt, x, y) -> set[int]:
    """One step; returns the addresses of the storages its model state keeps into the next:
    parameters, optimizer state, and what gradients live in (DDP's buckets, whose gradients are
    views of them; the other methods' gradients are freed by ``zero_grad``)."""
    _backward(model, model(x, y))
    opt.step()
    held = _state_addresses(model, opt)
    opt.zero_grad()
    return held


def prepare(method: str, setup: Setup, rank: int, world: int, mesh, build=None) -> Prepared:
    """Build ``method``'s model, compile (first step), warm up, and measure memory and bytes.

    ``build(method, cfg, mesh, size)`` makes the model (default: this module's ``_build``;
    benchmarks/tp.py passes its tensor-parallel one); ``rank`` and ``world`` choose this rank's
    slice of the batches (the data-parallel rank and size).

    Memory: each of ``MEMORY_STEPS`` steady-state steps is traced; the step's peak is the most
    bytes alive during it, counted from before the model was built (so model state, optimizer
    state, communication buffers and activations are all in), with the step's start holding
    only what existed once the model was built plus the storages the model state kept from the
    previous step (``AllocationTrace.step_peak``). The trace can only over-count (NOTE: frees
    the profiler does not see, zerofx/metrics.py), so the least of the measured steps' peaks
    is reported.
    """
    import zerofx
    from zerofx.measure.allocations import AllocationTrace
    from zerofx.models import GPTConfig

    cfg = GPTConfig(**SIZES[setup.size])
    batches = list(_batches(cfg, setup, world, 2))
    mine = slice(rank * setup.batch, (rank + 1) * setup.batch) if method != "single" else slice(None)
    x, y = batches[0][0][mine], batches[0][1][mine]
    gc.collect()
    with AllocationTrace() as trace:
        model = (build or _build)(method, cfg, mesh, setup.size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if method == "deepspeed":
            model, opt = _deepspeed(model, opt, setup.batch)
        built = trace.mark()
        start = time.perf_counter()
        _step(model, opt, x, y)
        first = time.perf_counter() - start
        for _ in range(setup.warmup - 2):
            _step(model, opt, x, y)
        held = _held_step(model, opt, x, y)
        gc.collect()  # compilation leaves reference cycles holding tensors; not a step's cost
        spans, comm_bytes = [], None
        for i in range(MEMORY_STEPS):
            t0 = trace.mark()
            # collectives are counted over the whole step: ZeRO-1/2 refresh their whole copies
            # in the optimizer step
            if i == 0 and method.startswith("zerofx"):
                with zerofx.CollectiveCounter() as comm:
                    model(x, y).backward()
                    opt.step()
                comm_bytes = comm.total_bytes
            elif i == 0 and method == "fsdp2":
                counter = _C10dCounter(world)
                with counter:
                    model(x, y).backward()
                    opt.step()
                comm_bytes = counter.bytes
            else:
                _backward(model, model(x, y))
                opt.step()
            if i == 0:
                state = _state_bytes(model, opt)
            next_held = _state_addresses(model, opt)
            opt.zero_grad()
            spans.append((t0, trace.mark(), held))
            held = next_held
    peak = min(trace.step_peak(t0, t1, built, held) for t0, t1, held in spans)
    if method == "ddp":
        psi = sum(p.numel() * p.element_size() for p in model.parameters())
        comm_bytes = 2 * psi * (world - 1) // world
    if method in ("fsdp2_compile", "single", "deepspeed"):  # DeepSpeed's collectives: its own comm layer
        comm_bytes = 0 if method == "single" else None
    stats = {"first_s": first, "peak_bytes": peak, "state_bytes": state, "comm_bytes": comm_bytes}
    return Prepared(model, opt, batches, mine, stats, [])


def time_round_robin(prepared: dict[str, Prepared], steps: int) -> None:
    """Time ``steps`` steps of every method, interleaved: step i of every method runs before
    step i+1 of any, so load that comes and goes on a shared machine lands on every method
    alike instead of on whichever ran during it. The order rotates by one method each round, so
    no method always runs right after the same other one (a method can leave threads or caches
    behind that slow whatever follows it). Ranks start each step together."""
    methods = list(prepared.values())
    if not methods:  # every method failed to set up: nothing to time (their error rows say why)
        return
    for i in range(steps):
        start = i % len(methods)
        for p in methods[start:] + methods[:start]:
            x, y = p.batches[i % 2][0][p.mine], p.batches[i % 2][1][p.mine]
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            _step(p.model, p.opt, x, y)
            p.times.append(time.perf_counter() - start)


def result(p: Prepared) -> dict:
    median = statistics.median(p.times)
    return {
        "step_s": median,
        "compile_s": max(p.stats["first_s"] - median, 0.0),
        **{k: v for k, v in p.stats.items() if k != "first_s"},
    }


def measure_methods(setup: Setup, rank: int, world: int, mesh, build=None) -> dict:
    """Every method of ``setup`` prepared (``prepare``: ``rank``/``world`` pick the batch slice,
    ``build`` the model), then timed interleaved; a method that failed on any rank is an error
    row on all of them. Method -> ``result`` (or ``{"error": ...}``)."""
    out, prepared = {}, {}
    for method in setup.methods:
        try:
            prepared[method] = prepare(method, setup, rank, world, mesh, build)
        except Exception:
            out[method] = {"error": traceback.format_exc(limit=6)}
        dist.barrier()
    # A method that failed on one rank must not run on the others (its collectives would hang).
    ok = torch.tensor([1 if m in prepared else 0 for m in setup.methods])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    for m, flag in zip(setup.methods, ok.tolist()):
        if not flag and m in prepared:
            del prepared[m]
            out[m] = {"error": "failed on another rank"}
    time_round_robin(prepared, setup.steps)
    for m, p in prepared.items():
        out[m] = result(p)
        if dist.get_rank() == 0:
            print(f"  [{setup.size} w{dist.get_world_size()}] {m}: {out[m]['step_s'] * 1e3:.1f} ms", flush=True)
    return {m: out[m] for m in setup.methods}


def _rank_main(setup: Setup) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    try:
        return measure_methods(setup, rank, world, mesh)
    finally:
        dist.destroy_process_group()


def run_world(setup: Setup, world: int) -> list[dict]:
    return launch_local(_rank_main, world, setup)


def combine(size: str, world: int, launches: list[list[dict]], single: dict | None) -> list[dict]:
    """Rows over one or more launches of the same setup: per launch, the slowest rank's median
    sets a method's pace and its ratio to FSDP2 eager of that launch; across launches, the
    median of those (``ratio_lo``/``ratio_hi``: the least and greatest)."""
    per_launch = [summarize(size, world, per_rank, single if i == 0 else None) for i, per_rank in enumerate(launches)]
    rows = []
    for row in per_launch[0]:
        if row["method"].startswith("single"):
            rows.append(row)
            continue
        mine = [r for rows_ in per_launch for r in rows_ if r["method"] == row["method"]]
        same = [r for r in mine if "error" not in r]
        if len(same) != len(launches):  # a launch it failed in: not a median over the others, unsaid
            failed = [i + 1 for i, r in enumerate(mine) if "error" in r]
            first = next(r for r in mine if "error" in r)
            where = "" if len(launches) == 1 else f"launch(es) {failed} of {len(launches)}: "
            rows.append({**first, "error": where + first["error"]})
            continue
        ratios = [r["ratio_to_fsdp2"] for r in same if r["ratio_to_fsdp2"] is not None]
        merged = dict(row)  # comm and state bytes do not change between launches
        for key in ("step_s", "compile_s", "peak_bytes"):
            merged[key] = statistics.median(r[key] for r in same)
        merged["ratio_to_fsdp2"] = statistics.median(ratios) if ratios else None
        merged["ratio_lo"], merged["ratio_hi"] = (min(ratios), max(ratios)) if ratios else (None, None)
        merged["launches"] = len(same)
        rows.append(merged)
    fsdp2 = next((r for r in rows if r["method"] == "fsdp2" and "error" not in r), None)
    for r in rows:  # against the FSDP2 row printed beside it (the median), not launch 1's
        if r["method"].startswith("single"):
            r["ratio_to_fsdp2"] = r["step_s"] / fsdp2["step_s"] if fsdp2 else None
    return rows


def summarize(size: str, world: int, per_rank: list[dict], single: dict | None) -> list[dict]:
    rows = []
    fsdp2 = [r.get("fsdp2", {}) for r in per_rank]
    base = max(r["step_s"] for r in fsdp2) if all("step_s" in r for r in fsdp2) else None
    methods = list(per_rank[0])
    if single is not None:
        rows.append(
            {
                "size": size,
                "world": world,
                "method": "single (1 process, global batch)",
                **single,
                "ratio_to_fsdp2": single["step_s"] / base if base else None,
            }
        )
    for m in methods:
        ok = [r[m] for r in per_rank if "error" not in r[m]]
        if len(ok) != len(per_rank):
            err = next(r[m]["error"] for r in per_rank if "error" in r[m])
            rows.append({"size": size, "world": world, "method": m, "error": err.strip().splitlines()[-1]})
            continue
        step = max(r["step_s"] for r in ok)  # the slowest rank sets the pace
        rows.append(
            {
                "size": size,
                "world": world,
                "method": m,
                "step_s": step,
                "compile_s": max(r["compile_s"] for r in ok),
                "peak_bytes": max(r["peak_bytes"] for r in ok),
                "state_bytes": max(r["state_bytes"] for r in ok),
                "comm_bytes": ok[0]["comm_bytes"],
                "ratio_to_fsdp2": step / base if base else None,
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    lines = [
        "| size | N | method | step ms | ×FSDP2 eager | compile s | peak MiB/rank | state MiB/rank | comm MiB/step/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['world']} | {r['method']} | failed: {r['error']} | | | | | |")
            continue
        ratio = "n/a" if r.get("ratio_to_fsdp2") is None else f"{r['ratio_to_fsdp2']:.2f}"
        if r.get("launches", 1) > 1 and r.get("ratio_lo") is not None:
            ratio += f" ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f})"
        lines.append(
            f"| {r['size']} | {r['world']} | {r['method']} | {r['step_s'] * 1e3:.1f} | {ratio} | "
            f"{r['compile_s']:.1f} | {mib(r['peak_bytes'])} | {mib(r['state_bytes'])} | {mib(r['comm_bytes'])} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Two panels per model size: step time as a multiple of FSDP2 eager (whiskers: the range
    over launches), and peak MiB per rank, one group of bars per world size. Needs matplotlib (``pip install 'zerofx[plots]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: pip install 'zerofx[plots]' ({e})") from None
    ok = [r for r in rows if "error" not in r and not r["method"].startswith("single")]
    sizes = sorted({r["size"] for r in ok})
    worlds = sorted({r["world"] for r in ok})
    methods = list(dict.fromkeys(r["method"] for r in ok))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 3.6 * len(sizes)), squeeze=False)
    width = 0.8 / max(len(methods), 1)
    for row_axes, size in zip(axes, sizes):
        for ax, key, label in (
            (row_axes[0], "ratio_to_fsdp2", "step time / FSDP2 eager"),
            (row_axes[1], "peak_bytes", "peak MiB per rank"),
        ):
            for i, method in enumerate(methods):
                values, spread = [], [[], []]
                for world in worlds:
                    r = next((r for r in ok if (r["size"], r["world"], r["method"]) == (size, world, method)), None)
                    v = None if r is None else r.get(key)
                    values.append(float("nan") if v is None else (v / 2**20 if key == "peak_bytes" else v))
                    lo, hi = (r.get("ratio_lo"), r.get("ratio_hi")) if r is not None else (None, None)
                    ranged = key == "ratio_to_fsdp2" and lo is not None and v is not None
                    spread[0].append(v - lo if ranged else 0.0)
                    spread[1].append(hi - v if ranged else 0.0)
                ax.bar(
                    [w + i * width for w in range(len(worlds))],
                    values,
                    width,
                    label=method,
                    yerr=spread if key == "ratio_to_fsdp2" else None,
                    capsize=3,
                )
            if key == "ratio_to_fsdp2":
                ax.axhline(1.0, color="black", linewidth=0.8)
                ax.axhline(0.9, color="gray", linewidth=0.8, linestyle="--")
            ax.set_xticks([w + width * (len(methods) - 1) / 2 for w in range(len(worlds))])
            ax.set_xticklabels([f"N={w}" for w in worlds])
            ax.set_title(f"{size}: {label}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=positive_int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["small"], choices=sorted(SIZES))
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="steps before measuring (>= 2: the last notes what model state a step keeps)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        type=_method,
        help=f"of {', '.join(METHODS + OPTIONAL_METHODS)}; or zerofx:KEY=VALUE;... (zerofx.compile's options)",
    )
    parser.add_argument(
        "--launches",
        type=positive_int,
        default=1,
        help="run each world size this many times (fresh processes); report median ratios and range",
    )
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--plot", help="draw step-time ratios and peak memory here (PNG; needs matplotlib)")
    parser.add_argument("--from-json", help="do not run: plot/print the rows of an earlier --json file")
    args = parser.parse_args(argv)
    if args.warmup < 2:
        parser.error("--warmup must be at least 2 (the first compiles; the last notes what a step keeps)")

    if args.from_json:
        try:
            with open(args.from_json) as f:
                rows = json.load(f)["rows"]
        except OSError as e:
            parser.error(f"--from-json: cannot read {args.from_json}: {e.strerror}")
        except (ValueError, KeyError, TypeError):
            parser.error(f"--from-json: {args.from_json} is not a --json file of this script (no rows)")
    else:
        rows = run(args)
    table = markdown(rows)
    print(table)
    if args.json and not args.from_json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "torch": torch.__version__, "rows": rows}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


def skip_unavailable(methods: list[str]) -> list[str]:
    """``methods`` less ``deepspeed`` when DeepSpeed is not importable (said on stdout); with it,
    DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``, inherited by the ranks)."""
    if "deepspeed" not in methods:
        return methods
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        print("skipping method deepspeed: deepspeed is not importable (pip install 'zerofx[deepspeed]')", flush=True)
        return [m for m in methods if m != "deepspeed"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return methods


def run(args: argparse.Namespace) -> list[dict]:
    args.methods = skip_unavailable(list(args.methods))
    rows = []
    for size in args.sizes:
        for world in args.world_sizes:
            setup = Setup(size, args.batch, args.steps, args.warmup, tuple(args.methods))
            print(f"{size}, world size {world}:", flush=True)
            torch.set_num_threads(1)
            alone = {
                "single": prepare(
                    "single", Setup(size, args.batch * world, args.steps, args.warmup, ("single",)), 0, 1, None
                )
            }
            time_round_robin(alone, args.steps)
            single = {**result(alone["single"]), "batch": args.batch * world}
            del alone
            rows += combine(size, world, [run_world(setup, world) for _ in range(args.launches)], single)
    return rows


if __name__ == "__main__":
    sys.exit(main())
