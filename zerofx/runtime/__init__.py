"""What runs outside the compiled graphs, on every step: per-parameter state and the hooks that
refresh whole copies and reduce at the accumulation boundary (params), the flat-bucket
collectives they issue (eager_buckets), optimizers stepping local shards (local_step), gradient
accumulation (accumulation), loss scaling (loss_scaling), and model state placed in host memory
or memory-mapped files (offload_store). Imports the leaf layer (zerofx.ir, options) only.
"""
