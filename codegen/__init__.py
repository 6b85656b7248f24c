"""Code generation: turn the rewritten ATen graph into something that runs.

Today one executor exists: ``"aten"`` runs the graph op by op (FX's generated Python code,
which frees every value after its last use). Triton kernels for fusible regions come next.
"""

from zerofx.codegen.executor import make_executor

__all__ = ["make_executor"]
