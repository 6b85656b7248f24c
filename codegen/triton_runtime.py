"""Running generated kernels: load their source once, launch them, fall back to ATen when they fail.

Triton's ``@jit`` needs the kernel's source in a real file (it reads it back with ``inspect``),
so each generated module is written under a per-process cache folder and imported from there.
Modules are cached by the kernel's signature (its source without node names), so a group that
appears in every layer, or in every recompilation of a frame, is loaded and compiled once;
Triton's own JIT cache then keeps one binary per device and argument-type specialisation.

Whether kernels run on a GPU or in Triton's CPU interpreter (``TRITON_INTERPRET=1``) is decided
when a module is loaded, so the cache keys include the mode.

A ``FusedKernel`` is what the rewritten graph calls for a fused group. Its contract: the same
results as the group's ATen ops, always. It launches the kernel when the inputs have the layout
the kernel was specialised for; otherwise, or if compiling or launching the kernel raises (a
Triton compile error on some GPU), it runs the group's original ATen ops instead, remembers
the failure for this kernel only, and reports it once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

import torch
from torch import fx

from zerofx.codegen.triton_emit import KernelSource

log = logging.getLogger(__name__)

_lock = threading.Lock()
_modules: dict[tuple[str, bool], ModuleType] = {}
_stats = {"hits": 0, "misses": 0, "launches": 0, "fallbacks": 0}
_cache_dir: Path | None = None


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")  # as Triton reads it


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def launch_problem(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on tensors of ``device`` in this process; None if they can.

    # NOTE: interpreter mode is fixed at import
    Triton decides GPU or interpreter when a function is decorated, and triton.language's own
    helpers (tl.sum, tl.sigmoid, ...) are decorated when triton is imported. So
    ``TRITON_INTERPRET=1`` only works if it was set before the first ``import triton``; set
    later, our kernels would be interpreted but could not call those helpers.
    """
    if not triton_available():
        return "triton is not installed"
    if interpreting():
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.sum, InterpretedFunction):
            return "TRITON_INTERPRET=1 was set after triton was imported (set it before)"
        return None if device.type == "cpu" else f"the Triton interpreter runs on CPU tensors, not {device}"
    if device.type != "cuda" or not torch.cuda.is_available():
        hint = " (set TRITON_INTERPRET=1 before importing triton to run kernels on CPU)" if device.type == "cpu" else ""
        return f"Triton kernels need a CUDA device, the graph is on {device}{hint}"
    return None


def can_launch(device: torch.device) -> bool:
    return launch_problem(device) is None


def cache_dir() -> Path:
    global _cache_dir
    if _cache_dir is None:
        root = os.environ.get("ZEROFX_KERNEL_DIR")
        _cache_dir = Path(root) if root else Path(tempfile.mkdtemp(prefix="zerofx_kernels_"))
        _cache_dir.mkdir(parents=True, exist_ok=True)
    return _cache_dir


def cache_info() -> dict[str, int]:
    """Module cache hits and misses, kernel launches and ATen fallbacks since the process started."""
    return dict(_stats, size=len(_modules))


def load(kernel: KernelSource) -> ModuleType:
    """The imported module of ``kernel`` (its ``launch`` runs it), from the cache when possible."""
    key = (kernel.signature, interpreting())
    with _lock:
        module = _modules.get(key)
        if module is not None:
            _stats["hits"] += 1
            return module
        _stats["misses"] += 1
        suffix = "_interp" if key[1] else ""
        path = cache_dir() / f"{kernel.name}{suffix}.py"
        path.write_text(kernel.source)
        spec = importlib.util.spec_from_file_location(f"zerofx_kernels.{kernel.name}{suffix}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # triton resolves the kernel's globals through its module
        spec.loader.exec_module(module)
        _modules[key] = module
        return module


def group_module(members: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> fx.GraphModule:
    """The group's ATen ops as a standalone graph: ``(*inputs) -> tuple(outputs)``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in members:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _quiet_masked_lanes():
    """The interpreter computes masked-off lanes too (log(0), 0/0): numpy would warn about them."""
    import numpy as np

    return np.errstate(all="ignore")


def _layout(val: torch.Tensor) -> tuple:
    """What a kernel was specialised to: device type, shape, dtype, strides of non-trivial dims."""
    return (val.device.type, tuple(val.shape), val.dtype, tuple(st for st, s in zip(val.stride(), val.shape) if s != 1))


class FusedKernel:
    """A fused group at run time (see the module docstring for its fallback contract)."""

    def __init__(
        self,
        kernel: KernelSource,
        inputs: Sequence[fx.Node],
        outputs: Sequence[fx.Node],
        fallback: Callable,
        on_failure: Callable[[str, str], None] | None = None,
    ):
        self.kernel = kernel
        self.__name__ = self.__qualname__ = kernel.name
        self.__module__ = "zerofx_kernels"
        self.fallback = fallback
        self.on_failure = on_failure
        self.input_layouts = [_layout(n.meta["val"]) for n in inputs]
        self.outputs = [(tuple(v.shape), tuple(v.stride()), v.dtype) for v in (n.meta["val"] for n in outputs)]
        self.error: str | None = None
        self.launches = 0
        self.fallbacks = 0
        self._launch: Callable | None = None

    def _ready(self) -> Callable:
        if self._launch is None:
            self._launch = load(self.kernel).launch
        return self._launch

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.error is None and [_layout(a) for a in args] == self.input_layouts:
            device = args[0].device
            outs = tuple(
                torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in self.outputs
            )
            try:
                launch = self._ready()
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        launch(*args, *outs)
                else:
                    with _quiet_masked_lanes():
                        launch(*args, *outs)
                self.launches += 1
                _stats["launches"] += 1
                return outs
            except Exception as e:  # compile or launch failure: this kernel runs as ATen from now on
                self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                log.warning(
                    "zerofx: Triton kernel %s failed (%s); running its ATen ops instead", self.kernel.name, self.error
                )
                if self.on_failure is not None:
                    self.on_failure(self.kernel.name, self.error)
        elif self.error is None:
            log.debug("zerofx: %s called with a layout it was not specialised for; running ATen", self.kernel.name)
        self.fallbacks += 1
        _stats["fallbacks"] += 1
        return tuple(self.fallback(*args))

    def __repr__(self) -> str:
        return f"<FusedKernel {self.kernel.name}>"
