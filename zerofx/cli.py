"""The ``zerofx`` command line."""

from __future__ import annotations

import argparse
import decimal
import fractions
import math
import os
import sys

from zerofx.demo import DemoConfig, check_plotting, run_demo
from zerofx.errors import first_line


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
    demo.add_argument(
        "--param-dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="compute dtype; bf16 gathers bf16 from fp32 master shards",
    )
    demo.add_argument("--plot", dest="plot_dir", default=None, help="write loss.png and memory.png here")
    demo.add_argument(
        "--plan", action="store_true", help="zerofx plan the run first; print prediction beside measurement"
    )
    demo.add_argument(
        "--progress",
        choices=("auto", "bar", "lines"),
        default="auto",
        help="a progress bar redrawn in place, or a line per step (auto: a bar on a terminal)",
    )
    verify = sub.add_parser(
        "verify",
        help="train MODULE:FACTORY sharded and unsharded; report where they differ",
        description="Train the model that MODULE:FACTORY builds for N steps with zerofx on "
        "local gloo ranks and, on every rank, with an unsharded replica that reproduces "
        "zerofx's arithmetic (zerofx.testing.ShardedReference); report per step the loss "
        "difference and the worst gradient and parameter divergence by name, and the first "
        "divergent step and tensor. FACTORY(**kwargs) returns (model, batch_fn): "
        "model(*batch) is a scalar mean loss, batch_fn(n, generator) a tuple of tensors "
        "with n samples. MODULE is imported with the current directory on the path. Exit "
        "status: 0 bit-identical, 1 divergent, 2 not verifiable (also: a bad argument or --json path, "
        "said before any rank starts, or a rank that failed, its error on one line).",
    )
    verify.add_argument("factory", metavar="MODULE:FACTORY")
    verify.add_argument(
        "--world-size",
        "-n",
        type=int,
        default=2,
        help="ranks to start (default 2; one rank shards nothing, and checks the compiled path only)",
    )
    verify.add_argument("--steps", type=int, default=5)
    verify.add_argument("--batch", type=int, default=2, help="samples per rank per step (default 2)")
    verify.add_argument("--lr", type=float, default=1e-3)
    verify.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this global norm")
    verify.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage (default 3)")
    verify.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for FACTORY")
    verify.add_argument("--json", dest="json_path", default=None, help="also write every rank's report here")
    convert = sub.add_parser(
        "convert",
        help="write a zerofx checkpoint's model unsharded: HF safetensors or torch files",
        description="Read the model of CHECKPOINT (a zerofx.checkpoint.save folder, any world size) "
        "and write it unsharded into the new folder OUT, one file at a time (memory stays near one "
        "output file): --to hf writes safetensors (+ index, + config.json when the checkpoint is of "
        "an HF model or --config is given), loadable by from_pretrained(OUT); --to torch writes "
        "torch.save files in the same layout. OUT must not exist.",
    )
    convert.add_argument("checkpoint", metavar="CHECKPOINT")
    convert.add_argument("out", metavar="OUT")
    convert.add_argument("--to", choices=("hf", "torch"), default="hf", help="output format (default hf)")
    convert.add_argument(
        "--max-shard-size", default="2GiB", help="largest output file, e.g. 5GB, 500MiB or bytes (default 2GiB)"
    )
    convert.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="cast on the way")
    convert.add_argument("--config", default=None, help="config.json to write alongside (HF)")
    _add_plan_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    # Every error from here on is the subcommand's, with its usage: argparse would report an
    # unknown flag with the top-level usage, which lists no flag of any subcommand.
    parser = sub.choices[args.command]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("demo", "verify") and "TORCHELASTIC_RUN_ID" in os.environ:
        # every torchrun worker would start its own --world-size ranks: N copies of the run, each
        # printing its report and writing the same --json and dump files
        parser.error(
            f"zerofx {args.command} starts its own ranks (--world-size); run it as a plain command, not under torchrun"
        )

    if args.command == "demo":
        _check_demo_sizes(parser, args, d.heads)
        problem = _check_demo_paths(args)
        if problem:  # said before any rank starts: the ranks would fail deep in a compile, or after training
            print(f"zerofx demo: {problem}", file=sys.stderr)
            return 2
        cfg = DemoConfig(
            world_size=args.world_size,
            steps=args.steps,
            batch=args.batch,
            seq_len=args.seq_len,
            layers=args.layers,
            d_model=args.d_model,
            dump_dir=args.dump_dir,
            stage=args.stage,
            param_dtype=None if args.param_dtype == "fp32" else args.param_dtype,
            progress=args.progress == "bar" or (args.progress == "auto" and sys.stdout.isatty()),
            plot_dir=args.plot_dir,
            plan=args.plan,
        )
        if cfg.plot_dir:
            check_plotting()
        try:
            run_demo(cfg)
        except Exception as e:
            if not _ranks_failed(e):
                raise
            # the failing rank printed its own traceback; the launcher's table of it says nothing more
            print(f"zerofx demo: a rank failed: {_rank_failure(e)}", file=sys.stderr)
            return 1
    elif args.command == "verify":
        return _verify(parser, args)
    elif args.command == "convert":
        return _convert(parser, args)
    elif args.command == "plan":
        return _plan(parser, args)
    return 0


def _json_object(text: str) -> dict:
    """``--kwargs``: a JSON object, or a ValueError saying what is wrong with it."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kwargs is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--kwargs must be a JSON object")
    return value


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from zerofx.planner import BUILTIN_MODELS

    plan = sub.add_parser(
        "plan",
        help="predict memory, communication and step time per rank, at any scale, before launch",
        description="Build MODEL with fake tensors (no memory), simulate WORLD_SIZE ranks with a fake "
        "process group, run zerofx's real pass pipeline on one training step and report per rank: "
        "model state, activations, the peak and where it occurs, collective bytes per mesh dimension, "
        "a roofline step time, and with --device-memory the largest batch and sequence that fit. "
        f"MODEL: a built-in shape ({', '.join(BUILTIN_MODELS)}) or MODULE:FUNCTION returning an nn.Module "
        "(called with --kwargs). Exit status 0; 1 for bad input (2 for a malformed command line, as argparse says); 3 when it does not fit --device-memory.",
    )
    plan.add_argument("model", metavar="MODEL")
    plan.add_argument("--world-size", "-n", type=int, default=None, help="ranks (default: the mesh's product)")
    plan.add_argument("--mesh", default=None, help="mesh shape, e.g. 128x8 (replicate x shard); default 1-D")
    plan.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size inside each node (the model's plan from zerofx.tensor_parallel.plan_for); "
        "--mesh is then the data-parallel size (or replicate x shard), the job has mesh x tp ranks",
    )
    plan.add_argument("--batch", type=int, default=1, help="sequences per rank per micro-step (default 1)")
    plan.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step over all ranks: --batch is it / (data-parallel size x --grad-accumulation)",
    )
    plan.add_argument(
        "--grad-accumulation",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step, the first N-1 under zerofx.no_sync: each rank holds whole "
        "gradients across them (default 1)",
    )
    plan.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's, else 1024)")
    plan.add_argument("--param-dtype", choices=("bf16", "fp16", "fp32"), default=None, help="compute dtype")
    plan.add_argument("--stage", type=int, choices=(1, 2, 3), default=None, help="ZeRO stage (default 3)")
    plan.add_argument(
        "--activation-budget",
        type=_activation_budget,
        default=None,
        help="zerofx's activation_budget: bytes (an integer or a size, e.g. 10MiB) or a fraction in (0, 1]",
    )
    plan.add_argument(
        "--checkpoint-modules",
        default=None,
        help="comma-separated module patterns to recompute in the backward, e.g. 'blocks.*' (per-block checkpoints)",
    )
    plan.add_argument("--offload-optimizer", choices=("none", "host", "disk"), default=None)
    plan.add_argument("--quantize-weights", choices=("int8", "fp8"), default=None, help="ZeRO++ qwZ")
    plan.add_argument("--quantize-grads", choices=("int8", "int4"), default=None, help="ZeRO++ qgZ")
    plan.add_argument(
        "--secondary-shard", action="store_true", default=None, help="ZeRO++ hpZ (a 2-D --mesh: nodes x ranks per node)"
    )
    plan.add_argument("--device", default="h100", help="rates to price the step with: cpu, a100, h100, h200")
    plan.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GiB: solve for what fits")
    plan.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "adafactor"), default="adamw")
    plan.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default nccl (gloo for cpu)")
    plan.add_argument("--compare", action="store_true", help="also plan each memory option that changes the answer")
    plan.add_argument(
        "--exact",
        action="store_true",
        help="trace every block of a built-in model (default: deeper than 4 blocks, from traces of 3 and 4)",
    )
    plan.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for MODULE:FUNCTION")
    plan.add_argument(
        "--inputs",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a function (batch, seq) -> (args, kwargs) giving the model's inputs; needed for a model "
        "without a config.vocab_size (a language model's token inputs are made by default)",
    )
    plan.add_argument("--json", dest="json_path", default=None, help="write the plan as JSON here")
    plan.add_argument("--plot", dest="plot_path", default=None, help="draw the step's memory timeline (PNG)")


def _check_demo_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, heads: int) -> None:
    """Every size of the demo's run and model checked before any rank starts (a bad one would
    fail inside every rank, deep in a trace)."""
    sizes = {
        "--world-size": args.world_size,
        "--steps": args.steps,
        "--batch": args.batch,
        "--seq-len": args.seq_len,
        "--layers": args.layers,
        "--d-model": args.d_model,
    }
    bad = [f"{flag} {value}" for flag, value in sizes.items() if value < 1]
    if bad:
        parser.error(f"{', '.join(bad)}: each of {', '.join(sizes)} must be at least 1")
    if args.d_model % heads:
        parser.error(
            f"--d-model {args.d_model}: the demo's GPT splits it over {heads} attention heads, so give a "
            f"multiple of {heads} (e.g. {-(-args.d_model // heads) * heads})"
        )


def _check_demo_paths(args: argparse.Namespace) -> str | None:
    """What is wrong with the folders the demo writes (``--dump``, or ``ZEROFX_DUMP`` without it,
    and ``--plot``), said as ``OPTION 'PATH': why``, or None."""
    import os

    dump = ("--dump", args.dump_dir) if args.dump_dir else ("ZEROFX_DUMP", os.environ.get("ZEROFX_DUMP"))
    for flag, path in (dump, ("--plot", args.plot_dir)):
        problem = _uncreatable(path) if path else None
        if problem:
            return f"{flag} {path!r}: {problem}"
    return None


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import os

    from zerofx import planner
    from zerofx.errors import ZeroFXError

    def fail(message: str) -> int:
        print(f"zerofx plan: {message}", file=sys.stderr)
        return 1

    try:
        kwargs = _json_object(args.kwargs)
    except ValueError as e:
        return fail(str(e))
    mesh = None
    if args.mesh:
        try:
            mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
        except ValueError:
            return fail(f"--mesh {args.mesh!r}: give sizes joined by x, e.g. 128x8")
    elif args.world_size is None:  # (the planner's own message names its keywords)
        return fail("give the ranks: --world-size N (-n N) or --mesh, e.g. --mesh 128x8")
    if args.world_size is not None and args.world_size < 1:
        return fail(f"--world-size {args.world_size}: give at least 1 rank")
    for flag, path in (("--json", args.json_path), ("--plot", args.plot_path)):
        problem = _unwritable(path) if path else None
        if problem:  # said before planning, which can take minutes
            return fail(f"{flag} {path!r}: {problem}")
    if args.plot_path:
        check_plotting()
    if os.getcwd() not in sys.path:  # after the installed packages: a user's module, never a shadow of zerofx
        sys.path.append(os.getcwd())
    options = {
        k: v
        for k, v in {
            "stage": args.stage,
            "param_dtype": args.param_dtype if args.param_dtype != "fp32" else None,
            "activation_budget": args.activation_budget,
            "offload_optimizer": args.offload_optimizer,
            "checkpoint_modules": tuple(args.checkpoint_modules.split(",")) if args.checkpoint_modules else None,
            "quantize_weights": args.quantize_weights,
            "quantize_grads": args.quantize_grads,
            "secondary_shard": args.secondary_shard,
        }.items()
        if v is not None
    }
    try:
        memory = parse_size(args.device_memory) if args.device_memory else None
    except ValueError as e:
        return fail(f"--device-memory: {e}")
    if memory is not None and memory < 2**20 and args.device_memory.strip().isdigit():  # a unit left out?
        print(
            f"zerofx plan: --device-memory {args.device_memory} is {memory} bytes (no unit); "
            f"did you mean {args.device_memory.strip()}GiB?",
            file=sys.stderr,
        )
    try:
        inputs_fn = planner.import_callable(args.inputs, "--inputs") if args.inputs else None
        result = planner.plan(
            args.model,
            mesh,
            world_size=args.world_size,
            batch=args.batch,
            seq=args.seq,
            global_batch=args.global_batch,
            device=args.device,
            device_memory=memory,
            optimizer=args.optimizer,
            backend=args.backend,
            factory_kwargs=kwargs,
            compare=args.compare,
            exact=args.exact,
            grad_accumulation=args.grad_accumulation,
            tensor_parallel=args.tp,
            example_inputs_fn=inputs_fn,
            **options,
        )
    except ZeroFXError as e:
        return fail(str(e))
    print(result.report())
    try:
        if args.json_path:
            planner.dump_json(result, args.json_path)
            print(f"wrote {args.json_path}")
        if args.plot_path:
            print(f"wrote {planner.write_timeline_plot(result, args.plot_path)}")
    except OSError as e:  # checked before planning; the folder changed meanwhile
        return fail(f"cannot write {e.filename}: {e.strerror}")
    if result.fits is False:
        print(f"zerofx plan: {result.advice()}", file=sys.stderr)
        return 3
    return 0


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written as a new or replaced file, or None. Tried, not read off the
    permission bits alone: root passes ``os.access`` where a filesystem refuses (``/proc``, a
    read-only mount). Leaves nothing behind: a new file is removed, an existing one opened for
    appending, unchanged."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory: give a file name"
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    if os.path.lexists(path) and not os.path.exists(path):
        return None  # a dangling link: writing creates its target, which a probe would leave behind
    existed = os.path.exists(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK if existed else os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        os.close(os.open(path, flags, 0o666))
        if not existed:
            os.remove(path)
    except OSError as e:
        return f"not writable ({e.strerror})"
    return None


def _uncreatable(path: str) -> str | None:
    """Why ``path`` cannot be made a folder (with any missing parents) or written into, or None.
    Tried: the missing folders are made and removed again, an existing one gets a probe folder."""
    import contextlib
    import os
    import tempfile

    target = os.path.abspath(path)
    missing = []
    existing = target
    while not os.path.lexists(existing):
        missing.append(existing)  # deepest first
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return "exists and is not a folder" if existing == target else f"{existing} is not a folder"
    try:
        if missing:
            os.makedirs(target)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".zerofx-probe-", dir=target))
    except OSError as e:
        where = f"cannot write into {target}" if not missing else f"cannot create a folder in {existing}"
        return f"{where} ({e.strerror})"
    finally:
        for folder in missing:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    return None


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def _activation_budget(text: str) -> int | float:
    """``--activation-budget``: bytes (``1048576``, ``10MiB``, ``3GB``) or a fraction (``0.5``)."""
    if text.strip().isdigit():  # 0 included: save nothing the backward can rebuild
        return int(text)
    try:
        return float(text)  # a fraction (0.5, 5e-1); the planner refuses what is not in (0, 1]
    except ValueError:
        pass
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither bytes (e.g. 1048576, 10MiB, 3GB) nor a fraction in (0, 1] (e.g. 0.5)"
        ) from None


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ``"1024"`` -> 1024 (HF's max_shard_size spellings)."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number) :].lower()
    try:  # exact: 1.5GiB is whole bytes, 1.5 is not (it was truncated to 1); inf and nan raise here
        given = decimal.Decimal(number)
        if given.is_finite() and not -40 <= given.adjusted() <= 20:  # past int64, or under a byte in any unit:
            raise OverflowError  # no Fraction of a thousand-digit power of ten
        exact = fractions.Fraction(given) * _UNITS[unit]
    except (ArithmeticError, ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MiB, 1048576)") from None
    if not 1 <= math.floor(exact) < 2**63:  # whole bytes, at least one, an int64's worth at most
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MiB, 1048576)")
    if exact.denominator != 1 and _UNITS[unit] == 1:  # with a unit, a fraction of a byte rounds down
        raise ValueError(
            f"{text!r} is {given} bytes, not a whole number of them: give an integer or a size with a unit "
            "(e.g. 1.5GiB, 1536MiB)"
        )
    return math.floor(exact)


def _convert(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from zerofx import checkpoint
    from zerofx.errors import ZeroFXError

    try:
        max_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        parser.error(f"--max-shard-size: {e}")
    dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        out = checkpoint.export(
            args.checkpoint, args.out, to=args.to, max_shard_bytes=max_bytes, dtype=dtype, config=args.config
        )
    except ZeroFXError as e:
        print(f"zerofx convert: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # OUT's folder cannot be made or written, or a checkpoint file cannot be read
        print(f"zerofx convert: {_os_error(e, args.out)}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in out.iterdir())
    print(f"zerofx convert: wrote {out} ({len(files)} files: {', '.join(files)})")
    return 0


def _os_error(e: OSError, out: str) -> str:
    """One line for an OSError of ``checkpoint.export``: the path it names, as OUT where it is
    OUT or the temporary folder beside it that becomes OUT."""
    import os

    filename = str(e.filename) if e.filename is not None else None
    why = e.strerror or str(e)
    if filename is None:
        return f"cannot write OUT {out!r}: {why}"
    target = os.path.abspath(out)
    name = os.path.abspath(filename)
    if name == target or (
        os.path.dirname(name) == os.path.dirname(target)
        and os.path.basename(name).startswith(f".{os.path.basename(target)}.tmp-")
    ):
        return f"cannot write OUT {out!r}: {why} ({filename})"
    return f"{filename}: {why}"


def _ranks_failed(e: BaseException) -> bool:
    """Whether ``e`` is torch elastic's report of ranks that failed (ChildFailedError)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return isinstance(e, ChildFailedError)


def _rank_failure(e: BaseException) -> str:
    """One line for a failure of the ranks: torch elastic's ChildFailedError says it in a table
    that starts with a blank line; its first failure (by time) carries that rank's error."""
    first = getattr(e, "get_first_failure", None)
    if callable(first) and getattr(e, "failures", None):
        rank, failure = first()
        message = failure.message
        if isinstance(message, dict):  # the rank's error file: {"message": "Type: text", "extraInfo": ...}
            line = first_line(str(message.get("message", "")))
        elif failure.exitcode < 0 or failure.error_file_data.get("message") == message:  # a signal, or a file's
            line = first_line(message)
        else:  # no error file: torch's message is a link to its docs
            line = ""
        return f"rank {rank}: {line or f'exit code {failure.exitcode}'}"
    line = first_line(str(e))
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _verify(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import os

    from zerofx import testing

    if args.world_size < 1 or args.steps < 1 or args.batch < 1:
        parser.error("--world-size, --steps and --batch must be at least 1")
    try:
        kwargs = _json_object(args.kwargs)
    except ValueError as e:
        parser.error(str(e))
    if os.getcwd() not in sys.path:  # after the installed packages: a user's module, never a shadow of zerofx
        sys.path.append(os.getcwd())
    try:
        testing.load_factory(args.factory)  # a bad spec fails here, before any rank starts
    except ValueError as e:
        parser.error(str(e))
    for flag, path, check in (
        ("--json", args.json_path, _unwritable),
        ("ZEROFX_DUMP", os.environ.get("ZEROFX_DUMP"), _uncreatable),  # the ranks' dump_dir (zerofx.options)
    ):
        problem = check(path) if path else None
        if problem:  # said before any rank starts, not after the whole run
            print(f"zerofx verify: {flag} {path!r}: {problem}", file=sys.stderr)
            return 2
    try:
        reports = testing.verify_ranks(
            args.factory,
            args.world_size,
            steps=args.steps,
            batch_per_rank=args.batch,
            lr=args.lr,
            optimizer=args.optimizer,
            seed=args.seed,
            factory_kwargs=kwargs,
            max_grad_norm=args.max_grad_norm,
            stage=args.stage,
        )
    except Exception as e:  # a rank raised: torch's launcher has its traceback in the log above
        print(f"zerofx verify: a rank failed before the comparison finished: {_rank_failure(e)}", file=sys.stderr)
        return 2
    for r in reports:
        print(testing.format_json_report(r), flush=True)
    if args.json_path:
        try:
            with open(args.json_path, "w") as f:
                f.write(testing.dumps(reports))
        except OSError as e:  # checked before the run; the folder changed meanwhile
            print(f"zerofx verify: cannot write --json {args.json_path!r}: {e.strerror or e}", file=sys.stderr)
            return 2
    if any(r["problem"] for r in reports):
        return 2
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
