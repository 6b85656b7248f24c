"""The vocabulary every layer of zerofx shares, and nothing else: the ops a captured graph may
contain (marker ops, offload ops), which collectives there are and how their bytes count, and
the shard layout. Importing this package registers the ``zerofx::`` ops with the dispatcher.

It imports torch and the other leaf modules only (tests/test_layers.py holds it to that), so a
pass, a code generator or the runtime can use it without dragging in the rest of zerofx.
"""

from zerofx.ir import collectives, layout, markers, meta, offload_ops, quantize  # noqa: F401  (registers the ops)

__all__ = ["collectives", "layout", "markers", "meta", "offload_ops", "quantize"]
