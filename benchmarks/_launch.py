"""What the benchmarks share: launching ranks on this machine and timing a call."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerofx.launch import local_ranks


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 1 (a count of steps, ranks, rounds...), so a
    bad count is a usage error naming its option before any rank starts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def launch_local(fn: Callable, world: int, *args: Any) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world-1]`` (``zerofx.launch.local_ranks``), with one
    thread per rank whatever ``OMP_NUM_THREADS`` says: measured ranks share this machine's cores."""
    os.environ["OMP_NUM_THREADS"] = "1"
    return local_ranks(fn, world, *args, name="bench")


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, every rank starting each call together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A markdown table: ``header`` cells, then one row per entry of ``lines``."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def write_json(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` with the command line and torch version to ``path`` (nothing if None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"argv": sys.argv, "torch": torch.__version__, "rows": rows}, f, indent=2)


def small_hf_llama(
    n_layer: int,
    seq: int,
    *,
    vocab: int = 512,
    hidden: int = 128,
    intermediate: int = 352,
    heads: int = 4,
    kv_heads: int = 2,
):
    """A small HF ``LlamaForCausalLM`` from a config (needs the ``hf`` extra): by default vocab 512,
    width 128, 4 heads over 2 KV heads; SDPA attention, untied embeddings; built, never downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=n_layer,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)
