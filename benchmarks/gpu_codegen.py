"""GPU benchmark of zerofx's Triton codegen, in one call (a few minutes on one GPU):

    python benchmarks/gpu_codegen.py                 # on a machine with a CUDA GPU
    python benchmarks/gpu_codegen.py --cpu-smoke     # tiny shapes, Triton interpreter: checks the script runs

Three sections, each printed as a table of times and ratios and written to JSON
(``--out``, default benchmarks/results/gpu_codegen.json):

1. regions   fused regions (residual+LayerNorm, LayerNorm backward, softmax, log_softmax,
             RMSNorm, GELU) as zerofx's generated kernels vs ATen eager vs Inductor, same
             inputs; numerics checked against eager before timing.
2. adamw     FusedAdamW (one Triton launch per bucket) vs torch.optim.AdamW fused=True and
             foreach=True, on GPT-2-small-like parameter shapes.
3. gpt       one training step (forward, backward, AdamW) of zerofx's GPT on a 1-rank mesh,
             per executor: "aten", "triton", "inductor".

Ratios are "x faster than zerofx's Triton" style: ``eager_ms / triton_ms`` (>1 means the
generated kernels win). A global time budget (``--budget-s``, default 270) skips what is left,
saying so, rather than running over. Nothing is downloaded: shapes and models are synthetic.

The JSON is rewritten after every row, so a run killed at its caller's limit (gpu_check.py's)
keeps what it finished (``"complete": false`` until the end). A Triton kernel that fails to
compile or launch runs its ATen ops instead, by design, which would make a "triton" row time
ATen: each row records its kernel launches and ATen fallbacks (zerofx.codegen.triton_runtime's
counters), and every fallback, result out of tolerance or row that raised is listed under
``"problems"`` (gpu_check.py then calls the section degraded). On a GPU an inherited
``TRITON_INTERPRET`` is removed before Triton is imported (it would send every kernel to the CPU
interpreter, which refuses CUDA tensors: all fallbacks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sections", default="regions,adamw,gpt", help="comma-separated subset to run")
    p.add_argument("--skip-inductor", action="store_true", help="leave Inductor out (it compiles slowly on CPU)")
    p.add_argument("--budget-s", type=float, default=270.0, help="stop starting new measurements after this")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_codegen.json"))
    return p.parse_args()


ARGS = _parse()
REMOVED_INTERPRET = None
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see codegen/triton_runtime.py)
else:
    REMOVED_INTERPRET = os.environ.pop("TRITON_INTERPRET", None)  # see the module docstring


sys.path.insert(0, str(ROOT))
from benchmarks._checkout import import_checkout  # noqa: E402

import_checkout()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import zerofx  # noqa: E402
from zerofx.codegen.fused_adamw import FusedAdamW  # noqa: E402
from zerofx.codegen.triton_codegen import compile_triton  # noqa: E402
from zerofx.codegen.triton_runtime import FusedKernel, cache_info, interpreting  # noqa: E402

DEVICE = torch.device("cpu" if ARGS.cpu_smoke else "cuda")
START = time.perf_counter()
aten = torch.ops.aten
RESULTS: dict[str, Any] = {"complete": False, "problems": []}


def checkpoint() -> None:
    """Rewrite the JSON with everything so far (write, then rename: a kill mid-write leaves the
    previous version, never half a file)."""
    RESULTS["seconds"] = time.perf_counter() - START
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(RESULTS, indent=2, default=str))
    os.replace(tmp, out)


def problem(text: str) -> None:
    RESULTS["problems"].append(text)


def over_budget(reserve_s: float = 0.0) -> bool:
    """True when ``reserve_s`` more seconds would run past the budget: start nothing new."""
    return time.perf_counter() - START + reserve_s > ARGS.budget_s


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn: Callable[[], Any], reps: int = 50) -> float:
    """Median milliseconds per call (Triton's do_bench on GPU; a plain timer on CPU)."""
    if DEVICE.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(max(3, reps // 10)):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n== {title}")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


# --- 1. regions -------------------------------------------------------------------------------


def _regions(small: bool) -> list[tuple[str, Callable, list[torch.Tensor], float]]:
    """(name, fn, inputs, tolerance) for each fused region, at training-like sizes."""
    rows, hidden, vocab, seq, heads = (64, 96, 200, 24, 2) if small else (8192, 4096, 8192, 1024, 32)
    bf16 = torch.bfloat16

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=DEVICE, dtype=dtype)

    def add_layer_norm(x, r, w, b):
        h = x + r
        return h, F.layer_norm(h, (h.shape[-1],), w, b)

    def layer_norm_backward(g, x, mean, rstd, w, b, gr):
        dx, dw, db = aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])
        return dx + gr, dw, db

    def rms_norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    x = rnd(rows, hidden)
    mean, rstd = x.mean(-1, keepdim=True), torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
    attn_rows = 4 if small else 16
    return [
        ("add+layernorm fp32", add_layer_norm, [x, rnd(rows, hidden), rnd(hidden), rnd(hidden)], 1e-4),
        (
            "add+layernorm bf16",
            add_layer_norm,
            [
                rnd(rows, hidden, dtype=bf16),
                rnd(rows, hidden, dtype=bf16),
                rnd(hidden, dtype=bf16),
                rnd(hidden, dtype=bf16),
            ],
            5e-2,
        ),
        (
            "layernorm bwd fp32",
            layer_norm_backward,
            [rnd(rows, hidden), x, mean, rstd, rnd(hidden), rnd(hidden), rnd(rows, hidden)],
            1e-3,
        ),
        ("softmax bf16", lambda s: torch.softmax(s * 0.125, -1), [rnd(attn_rows, heads, seq, seq, dtype=bf16)], 2e-2),
        ("log_softmax fp32", lambda z: torch.log_softmax(z, -1), [rnd(rows, vocab)], 1e-4),
        ("rmsnorm bf16", rms_norm, [rnd(rows, hidden, dtype=bf16), rnd(hidden, dtype=bf16)], 5e-2),
        ("gelu(erf) bf16", lambda h: F.gelu(h), [rnd(rows, 4 * hidden, dtype=bf16)], 2e-2),
        ("gelu(tanh) fp32", lambda h: F.gelu(h, approximate="tanh") * 1.5, [rnd(rows, 4 * hidden)], 1e-4),
    ]


def _outputs(o: Any) -> list[torch.Tensor]:
    return list(o) if isinstance(o, (tuple, list)) else [o]


def run_regions() -> list[dict]:
    rows = RESULTS.setdefault("regions", [])
    for name, fn, inputs, tol in _regions(ARGS.cpu_smoke):
        if over_budget():
            rows.append({"region": name, "note": "skipped: time budget"})
            checkpoint()
            continue
        row: dict = {"region": name}
        rows.append(row)
        try:
            gm = make_fx(fn, tracing_mode="fake")(*inputs)
            fused = compile_triton(gm)
            kernels = [n.target for n in fused.graph.nodes if isinstance(n.target, FusedKernel)]
            row["kernels"] = len(kernels)
            ref = _outputs(fn(*inputs))
            got = _outputs(fused(*inputs))
            row["max_err"] = max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref))
            bound = tol * (1 + max(float(r.float().abs().max()) for r in ref))
            if row["max_err"] > bound:
                row["mismatch"] = f"max error {row['max_err']:.3g} > {bound:.3g}"
                problem(f"regions/{name}: {row['mismatch']}")
            row["eager_ms"] = bench_ms(lambda: fn(*inputs))
            row["triton_ms"] = bench_ms(lambda: fused(*inputs))
            # every call of every kernel counted: any fallback means triton_ms timed some ATen
            row["launches"] = sum(k.launches for k in kernels)
            row["fallbacks"] = sum(k.fallbacks for k in kernels)
            errors = sorted({f"{k.kernel.name}: {k.error}" for k in kernels if k.error})
            if errors:
                row["kernel_errors"] = errors
            if not kernels:
                problem(f"regions/{name}: no Triton kernel was generated (the region runs as ATen)")
            elif row["fallbacks"] or errors:
                why = f" ({errors[0]})" if errors else " (inputs in a layout it was not specialised for)"
                problem(f"regions/{name}: {row['fallbacks']} ATen fallback(s), {row['launches']} launch(es){why}")
            notes = [row.get("mismatch"), f"{row['fallbacks']} fallbacks" if row["fallbacks"] else None]
            notes.append(None if kernels else "no kernel")
            if any(notes):
                row["note"] = "; ".join(n for n in notes if n)
            if not ARGS.skip_inductor and not over_budget(reserve_s=0 if ARGS.cpu_smoke else 20):
                compiled = torch.compile(fn, fullgraph=True, dynamic=False)
                compiled(*inputs)
                row["inductor_ms"] = bench_ms(lambda: compiled(*inputs))
            row["eager/triton"] = row["eager_ms"] / row["triton_ms"]
            if "inductor_ms" in row:
                row["inductor/triton"] = row["inductor_ms"] / row["triton_ms"]
            nbytes = sum(t.numel() * t.element_size() for t in (*inputs, *got))
            row["triton_GB/s"] = nbytes / row["triton_ms"] / 1e6
        except Exception as e:  # one region failing must not lose the others
            row["note"] = f"error: {type(e).__name__}: {e}"
            problem(f"regions/{name}: {row['note'].splitlines()[0]}")
            traceback.print_exc()
        checkpoint()
        torch._dynamo.reset()
    table(
        "fused regions: zerofx Triton vs ATen eager vs Inductor (ms, ratios >1: Triton faster)",
        rows,
        [
            "region",
            "kernels",
            "launches",
            "fallbacks",
            "eager_ms",
            "triton_ms",
            "inductor_ms",
            "eager/triton",
            "inductor/triton",
            "triton_GB/s",
            "max_err",
            "note",
        ],
    )
    return rows


# --- 2. fused AdamW ---------------------------------------------------------------------------


def _gpt2_shapes(small: bool) -> list[tuple[int, ...]]:
    d, layers, vocab = (64, 2, 300) if small else (768, 12, 50257)
    shapes: list[tuple[int, ...]] = [(vocab, d), (1024 if not small else 64, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def run_adamw() -> list[dict]:
    shapes = _gpt2_shapes(ARGS.cpu_smoke)
    numel = sum(math.prod(s) for s in shapes)
    rows = RESULTS.setdefault("adamw", [])
    variants: list[tuple[str, Callable[[list], torch.optim.Optimizer]]] = [
        ("zerofx FusedAdamW", lambda ps: FusedAdamW(ps, lr=1e-3, weight_decay=0.1)),
        ("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True)),
    ]
    if DEVICE.type == "cuda":
        variants.append(("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True)))
    reference = None
    for name, make in variants:
        if over_budget():
            rows.append({"optimizer": name, "note": "skipped: time budget"})
            checkpoint()
            continue
        row: dict = {"optimizer": name, "params_M": numel / 1e6, "tensors": len(shapes)}
        rows.append(row)
        try:
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, device=DEVICE, generator=gen)) for s in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, device=DEVICE, generator=gen)
            opt = make(params)
            opt.step()
            sync()
            first = params[2].detach().clone()
            row["step_ms"] = bench_ms(opt.step, reps=20)
            if reference is None:
                reference = first
            else:  # one fp32 step from N(0, 1) values: a few ulp apart at most
                row["max_diff_after_1_step"] = float((first - reference).abs().max())
                if row["max_diff_after_1_step"] > 1e-5:
                    row["note"] = "mismatch"
                    problem(f"adamw/{name}: {row['max_diff_after_1_step']:.3g} from FusedAdamW after one step")
        except Exception as e:
            row["note"] = f"error: {type(e).__name__}: {e}"
            problem(f"adamw/{name}: {row['note'].splitlines()[0]}")
            traceback.print_exc()
        checkpoint()
    base = next((r["step_ms"] for r in rows if r["optimizer"] == "zerofx FusedAdamW" and "step_ms" in r), None)
    for r in rows:
        if base and "step_ms" in r:
            r["vs zerofx"] = r["step_ms"] / base
    checkpoint()
    table(
        "AdamW step over GPT-2-small shapes (ms; 'vs zerofx' >1: FusedAdamW faster)",
        rows,
        ["optimizer", "params_M", "tensors", "step_ms", "vs zerofx", "max_diff_after_1_step", "note"],
    )
    return rows


# --- 3. GPT training step per executor --------------------------------------------------------


def run_gpt() -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zerofx.models import GPT, GPTConfig, random_batch

    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group(
            "gloo" if DEVICE.type == "cpu" else "nccl", init_method=f"file://{store}", rank=0, world_size=1
        )
    cfg = (
        GPTConfig(vocab_size=96, seq_len=16, n_layer=2, n_head=4, d_model=32)
        if ARGS.cpu_smoke
        else GPTConfig(vocab_size=8192, seq_len=512, n_layer=4, n_head=12, d_model=768)
    )
    batch = 2 if ARGS.cpu_smoke else 8
    executors = ["aten", "triton"] + ([] if ARGS.skip_inductor else ["inductor"])
    rows = RESULTS.setdefault("gpt", [])
    for executor in executors:
        if over_budget(reserve_s=0 if ARGS.cpu_smoke else 45):  # a GPT compile takes tens of seconds
            rows.append({"executor": executor, "note": "skipped: time budget"})
            checkpoint()
            continue
        row: dict = {"executor": executor}
        rows.append(row)
        counted = cache_info()
        try:
            torch.manual_seed(0)
            model = GPT(cfg).to(DEVICE)
            zerofx.compile(model, init_device_mesh(DEVICE.type, (1,)), executor=executor)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            gen = torch.Generator().manual_seed(0)
            x, y = (t.to(DEVICE) for t in random_batch(cfg, batch, gen))

            def step() -> float:
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

            t = time.perf_counter()
            losses = [float(step()) for _ in range(2)]  # compiles
            sync()
            row["compile_s"] = time.perf_counter() - t
            row["step_ms"] = bench_ms(step, reps=10)
            row["loss_step1"], row["loss_step2"] = losses
        except Exception as e:
            row["note"] = f"error: {type(e).__name__}: {e}"
            problem(f"gpt/{executor}: {row['note'].splitlines()[0]}")
            traceback.print_exc()
        # zerofx's generated kernels over the row's compile, warm-up and timed steps
        now = cache_info()
        row["triton_launches"] = now["launches"] - counted["launches"]
        row["triton_fallbacks"] = now["fallbacks"] - counted["fallbacks"]
        if executor == "triton" and "step_ms" in row:
            if row["triton_fallbacks"] or not row["triton_launches"]:
                row["note"] = f"{row['triton_fallbacks']} ATen fallbacks, {row['triton_launches']} launches"
                problem(f"gpt/triton: {row['note']} (the row times ATen where it fell back)")
        aten = next((r for r in rows if r["executor"] == "aten" and "loss_step1" in r), None)
        if aten and executor != "aten" and "loss_step1" in row:
            for key in ("loss_step1", "loss_step2"):
                if abs(row[key] - aten[key]) > 1e-3 * abs(aten[key]):
                    row["note"] = f"{key} {row[key]:.6g} vs aten {aten[key]:.6g}"
                    problem(f"gpt/{executor}: {row['note']}")
                    break
        checkpoint()
        torch._dynamo.reset()
    base = next((r["step_ms"] for r in rows if r["executor"] == "triton" and "step_ms" in r), None)
    for r in rows:
        if base and "step_ms" in r:
            r["vs triton"] = r["step_ms"] / base
    checkpoint()
    table(
        f"GPT training step, 1-rank mesh ({cfg}, batch {batch}; 'vs triton' >1: triton faster)",
        rows,
        [
            "executor",
            "compile_s",
            "step_ms",
            "vs triton",
            "triton_launches",
            "triton_fallbacks",
            "loss_step1",
            "loss_step2",
            "note",
        ],
    )
    return rows


def main() -> None:
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": "cpu (Triton interpreter)" if ARGS.cpu_smoke else "cuda",
        "cpu_smoke": ARGS.cpu_smoke,
        "triton_interpreter": interpreting(),
        "removed_TRITON_INTERPRET": REMOVED_INTERPRET,
    }
    RESULTS["info"] = info
    if DEVICE.type == "cuda" and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    print(json.dumps(info), flush=True)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or pass --cpu-smoke to check the script on CPU")
    checkpoint()
    sections = {"regions": run_regions, "adamw": run_adamw, "gpt": run_gpt}
    for name in ARGS.sections.split(","):
        try:
            sections[name]()
        except Exception as e:  # a section that fails outside its rows must not lose the others
            RESULTS.setdefault(name, [])
            problem(f"{name}: error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            traceback.print_exc()
        checkpoint()
    RESULTS["complete"] = True
    checkpoint()
    if RESULTS["problems"]:
        print("\nproblems:\n  " + "\n  ".join(RESULTS["problems"]))
    print(f"\nwrote {ARGS.out} ({RESULTS['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
