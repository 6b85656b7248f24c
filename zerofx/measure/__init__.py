"""Measurement: what a step really costs. Model-state bytes (model_state), buffers the compiled
graphs allocate (graph_buffers: MemoryTracker), the allocator's and the kernel's view of memory
(allocations), the transient bytes of eager code on fake tensors (transient: what zerofx.plan
counts for the optimizer step), and the wrapper that counts a compiled graph's collectives each time it runs
(instrument). Imports the leaf layer and the cost model's op counts (zerofx.passes.cost_model).
"""
