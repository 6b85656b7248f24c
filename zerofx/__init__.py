"""zerofx: ZeRO data parallelism as a compiler over PyTorch FX graphs.

    model = zerofx.compile(model, mesh)              # ZeRO-3: parameters become 1/N shards
    opt = torch.optim.AdamW(model.parameters())      # so optimizer state is 1/N too

``zerofx.compile(model, mesh, stage=1 or 2, param_dtype=torch.bfloat16, ...)`` picks another ZeRO
stage or mixed precision (see ``zerofx.Options``); a 2-D mesh ``(replicate, shard)`` shards
hybridly; ``zerofx.no_sync`` accumulates gradients; ``zerofx.checkpoint`` saves and loads.

or, in two steps, ``zerofx.shard(model, mesh)`` then ``torch.compile(model, backend="zerofx")``.

Memory below the sum of its parts (docs/memory.md): ``activation_budget`` and the
``checkpoint*`` options recompute activations, ``offload_activations`` parks them in host memory
or on disk, ``offload_optimizer`` (with ``zerofx.offload_optimizer(opt)``) keeps master shards
and optimizer state there; ``zerofx.MemoryTracker`` measures what the compiled graphs allocate.

Before launch, ``zerofx.plan(model_fn, mesh_shape, ...)`` (or ``zerofx plan``) predicts a step's
memory, communication and time per rank at any scale, from fake tensors (zerofx/planner.py).
"""

import warnings

# torch warns "Failed to initialize NumPy" when it is imported without NumPy installed, and
# importing zerofx is what imports torch in zerofx's own processes (the demo's ranks). zerofx
# does not use NumPy (not a dependency), so that warning is not the user's to see from us.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from zerofx import checkpoint, ir  # noqa: F401  (ir registers the zerofx:: ops every layer uses)
from zerofx.api import Gathered, compile, explain, gathered
from zerofx.errors import ZeroFXError
from zerofx.ir.collectives import CollectiveCounter
from zerofx.measure.graph_buffers import MemoryTracker
from zerofx.measure.model_state import model_state_bytes
from zerofx.options import Options
from zerofx.planner import Plan, plan
from zerofx.runtime.accumulation import no_sync
from zerofx.runtime.loss_scaling import loss_scaler
from zerofx.runtime.offload_store import offload_optimizer
from zerofx.sharding import shard

__version__ = "0.1.0"

__all__ = [
    "compile",
    "explain",
    "gathered",
    "Gathered",
    "shard",
    "no_sync",
    "loss_scaler",
    "checkpoint",
    "Options",
    "ZeroFXError",
    "CollectiveCounter",
    "model_state_bytes",
    "MemoryTracker",
    "offload_optimizer",
    "plan",
    "Plan",
]
