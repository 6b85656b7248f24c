"""zerofx: ZeRO data parallelism as a compiler over PyTorch FX graphs.

    model = zerofx.compile(model, mesh)              # ZeRO-3: parameters become 1/N shards
    opt = torch.optim.AdamW(model.parameters())      # so optimizer state is 1/N too

or, in two steps, ``zerofx.shard(model, mesh)`` then ``torch.compile(model, backend="zerofx")``.
"""

from zerofx import ops as _ops  # noqa: F401  (registers the zerofx:: marker ops)
from zerofx.accumulation import no_sync
from zerofx.api import compile, explain
from zerofx.errors import ZeroFXError
from zerofx.metrics import CollectiveCounter, model_state_bytes
from zerofx.options import Options
from zerofx.sharding import shard

__version__ = "0.1.0"

__all__ = ["compile", "explain", "shard", "no_sync", "Options", "ZeroFXError", "CollectiveCounter", "model_state_bytes"]
