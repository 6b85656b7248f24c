"""Every ``node.meta`` / ``gm.meta`` key zerofx writes or reads, with what it means.

Passes talk to each other (and to the backend, the dump and codegen) only through these keys
and the graph itself. Each pass declares the keys it reads and writes in its contract
(``zerofx.passes.contract.Pass``); the pipeline checks, when it is built, that every key a pass
reads is written by a pass that runs before it, or is one torch itself may write (``external``).
Who writes and who reads each key is in the contracts, not here: this module only names them.
"""

from __future__ import annotations

__all__ = [
    "MetaKey",
    "ROLE",
    "RECOMPUTE",
    "OFFLOAD_TIER",
    "COLLECTIVE",
    "QUANTIZED",
    "BUCKET_SEGMENTS",
    "PASS",
    "KERNEL",
    "ACTIVATION_PLAN",
    "BORROWED_INPUTS",
    "SECONDARY",
    "KEYS",
]


class MetaKey(str):
    """A meta key: the string itself (``node.meta[ROLE]`` is ``node.meta["zerofx_role"]``), plus
    what it means, whether it lives on nodes or on the graph module, and whether torch (or the
    user's model) may write it before any pass runs."""

    meaning: str
    on: str
    external: bool

    def __new__(cls, name: str, meaning: str, on: str = "node", external: bool = False) -> "MetaKey":
        key = super().__new__(cls, name)
        key.meaning, key.on, key.external = meaning, on, external
        return key

    @property
    def name(self) -> str:
        return str.__str__(self)


ROLE = MetaKey(
    "zerofx_role",
    "which zerofx mechanism a node belongs to: 'gather' (a parameter's gather chain, "
    "recomputed in backward), 'kept_gather' (one selective unsharding keeps), 'secondary_gather' "
    "(hpZ: the backward's gather of secondary shards over the inner dimension), 'reduce', "
    "'offload', 'release' (a buffer the graph frees itself)",
)
RECOMPUTE = MetaKey(
    "recompute",
    "torch's CheckpointPolicy for the partitioner (MUST_SAVE / MUST_RECOMPUTE); "
    "torch.utils.checkpoint in the model writes it too",
    external=True,
)
AC_REGION = MetaKey(
    "ac_graph_id",
    "which torch.utils.checkpoint call in the model a node was traced in (AOTAutograd writes it "
    "with ``recompute``): the checkpoint pass recomputes such a region as a checkpointed module",
    external=True,
)
OFFLOAD_TIER = MetaKey(
    "zerofx_offload",
    "'host' | 'disk': the tier a saved activation is parked in between forward "
    "and backward (the partitioner copies it onto the forward's outputs and the "
    "backward's placeholders)",
)
COLLECTIVE = MetaKey(
    "zerofx_collective",
    "the algorithm a collective node runs when a pass lowered it onto another op "
    "(a gloo all-to-all that is a reduce-scatter); byte counts read it",
)
QUANTIZED = MetaKey(
    "zerofx_quantized",
    "on a collective that moves block-quantized bytes: (wire format, dtype and wire bytes per rank "
    "of the collective it replaced); the dump's summary and the collective counter read it",
)
BUCKET_SEGMENTS = MetaKey(
    "zerofx_bucket_segments",
    "on a bucketed all-gather or reduce-scatter: the values of each member's piece in one rank's row "
    "(a gather: its shard; a reduce-scatter: its chunk for one destination), in order; the quantize "
    "pass gives each its own blocks (zerofx/ir/quantize.py, NOTE: segments)",
)
PASS = MetaKey("zerofx_pass", "provenance: the pass that created the node (the runner writes it)")
KERNEL = MetaKey("zerofx_kernel", "codegen: the generated kernel a call node runs")
ACTIVATION_PLAN = MetaKey(
    "zerofx_activation_plan",
    "the checkpoint plan's numbers (budget, saved and recomputed bytes), read by the backend's plan check",
    on="graph",
)

BORROWED_INPUTS = MetaKey(
    "zerofx_borrowed_inputs",
    "a backward graph's inputs that are the forward's own inputs or views of them (parameter shards, "
    "user data) or share a buffer with an output the caller gets (returned logits): the backward "
    "dropping them frees nothing, their owner holds them; the backend writes it at the partition, "
    "the memory simulation reads it",
    on="graph",
)

SECONDARY = MetaKey(
    "zerofx_secondary",
    "hpZ: on an unshard marker whose backward re-gather reads a secondary shard instead, "
    "(id, inner group size, inner group name, first row, rows) of this rank's secondary shard; "
    "the partitioner copies it onto the forward's marker and the backward's recomputed one",
)

KEYS = (
    ROLE,
    RECOMPUTE,
    OFFLOAD_TIER,
    COLLECTIVE,
    QUANTIZED,
    BUCKET_SEGMENTS,
    PASS,
    KERNEL,
    ACTIVATION_PLAN,
    BORROWED_INPUTS,
    SECONDARY,
)
