"""Code generation: turn the rewritten ATen graph into something that runs (see docs/codegen.md).

    executor.py            "aten" (default), "triton", "inductor": graph -> boxed callable
    triton_codegen.py      the "triton" executor's compile step, stage by stage:
      decompose.py           composite ops (LayerNorm, softmax, GELU, ...) opened into primitives
      fusion.py              fusible regions, never across a collective; regions -> kernel calls
      triton_ops.py          how each ATen op is written in Triton
      triton_emit.py         one readable kernel per region (masks, dtypes, block sizes)
      triton_runtime.py      loading, caching, launching, per-kernel fallback to ATen
    multi_tensor.py        one launch over many tensors (pointer tables)
    collective_kernels.py  pack / unpack / average+accumulate around bucketed collectives
    fused_adamw.py         FusedAdamW: one launch per bucket of shards

Only executor.py is imported here; everything that needs Triton is imported on first use, so
zerofx works where Triton is not installed. ``FusedAdamW`` is importable from here too.
"""

from zerofx.codegen.executor import EXECUTOR_NAMES, make_executor

__all__ = ["EXECUTOR_NAMES", "make_executor", "FusedAdamW"]


def __getattr__(name: str):
    if name == "FusedAdamW":  # imports triton: only when asked for
        from zerofx.codegen.fused_adamw import FusedAdamW

        return FusedAdamW
    raise AttributeError(f"module 'zerofx.codegen' has no attribute {name!r}")
