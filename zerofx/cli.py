"""The ``zerofx`` command line."""

from __future__ import annotations

import argparse
import sys

from zerofx.demo import DemoConfig, run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerofx", description="ZeRO data parallelism as a compiler.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT with ZeRO on local gloo ranks")
    d = DemoConfig()
    demo.add_argument("--world-size", "-n", type=int, default=d.world_size, help="ranks to start (default 2)")
    demo.add_argument("--steps", type=int, default=d.steps)
    demo.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    demo.add_argument("--seq-len", type=int, default=d.seq_len)
    demo.add_argument("--layers", type=int, default=d.layers)
    demo.add_argument("--d-model", type=int, default=d.d_model)
    demo.add_argument("--dump", dest="dump_dir", default=None, help="write every pass's graphs here")
    demo.add_argument("--stage", type=int, choices=(1, 2, 3), default=d.stage, help="ZeRO stage (default 3)")
    demo.add_argument("--param-dtype", choices=("bf16", "fp32"), default=None,
                      help="compute dtype; bf16 gathers bf16 from fp32 master shards")
    args = parser.parse_args(argv)

    if args.command == "demo":
        if args.world_size < 1 or args.steps < 1:
            parser.error("--world-size and --steps must be at least 1")
        cfg = DemoConfig(world_size=args.world_size, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                         layers=args.layers, d_model=args.d_model, dump_dir=args.dump_dir, stage=args.stage,
                         param_dtype=None if args.param_dtype == "fp32" else args.param_dtype)
        run_demo(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
