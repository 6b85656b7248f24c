"""Peak resident memory of ``zerofx.checkpoint.export`` against the size of what it writes.

    python benchmarks/export_memory.py --model-mib 64 --tensor-mib 4 --shard-mib 8

Saves a model of ``--model-mib`` MiB of fp32 parameters (tensors of ``--tensor-mib``) as a
zerofx checkpoint in this process, then exports it to HF safetensors and to torch files in
``--shard-mib`` files, and reports how far each export raised the process's peak RSS (VmHWM,
reset before each) above its resident memory when it started. One warm-up export of a tiny
checkpoint first, so that imports DCP does on its first load are not counted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script (python benchmarks/x.py): this checkout's `benchmarks`, and its
    # zerofx whole (passes/ and codegen/ install into it: the bare source tree lacks them; benchmarks/_checkout.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._checkout import import_checkout

    import_checkout()

import zerofx.checkpoint as ck  # noqa: E402
from benchmarks._launch import markdown_table, positive_int, write_json  # noqa: E402
from zerofx.measure.allocations import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mib", type=positive_int, default=64)
    parser.add_argument("--tensor-mib", type=positive_int, default=4)
    parser.add_argument("--shard-mib", type=positive_int, default=8)
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    side = int((args.tensor_mib * 2**20 / 4) ** 0.5)
    count = max(1, args.model_mib // args.tensor_mib)
    with tempfile.TemporaryDirectory(prefix="zerofx-export-") as folder:  # its checkpoint and exports go with it
        ck.save(f"{folder}/tiny", nn.Linear(4, 4))
        ck.export(f"{folder}/tiny", f"{folder}/tiny_out")
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(count)])
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ck.save(f"{folder}/ckpt", model)
        del model
        gc.collect()
        rows = []
        for to in ("hf", "torch"):
            reset_peak_rss()
            base = rss_bytes()
            out = ck.export(f"{folder}/ckpt", f"{folder}/{to}", to=to, max_shard_bytes=args.shard_mib << 20)
            grew = peak_rss_bytes() - base
            files = [p for p in out.iterdir() if p.suffix != ".json"]
            largest = max(p.stat().st_size for p in files)
            rows.append(
                {
                    "to": to,
                    "model_bytes": model_bytes,
                    "files": len(files),
                    "largest_file": largest,
                    "peak_growth": grew,
                }
            )
    print(
        markdown_table(
            ["to", "model MiB", "files", "largest file MiB", "peak RSS growth MiB", "growth / largest file"],
            [
                [
                    r["to"],
                    f"{r['model_bytes'] / 2**20:.1f}",
                    str(r["files"]),
                    f"{r['largest_file'] / 2**20:.1f}",
                    f"{r['peak_growth'] / 2**20:.1f}",
                    f"{r['peak_growth'] / r['largest_file']:.2f}",
                ]
                for r in rows
            ],
        )
    )
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
