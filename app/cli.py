"""The `pdserve` command line: built-in models, offline generation, batch jobs
(`app/batch/cli.py`), benchmarks (`bench/cli.py`).

Results go to stdout (JSON where asked, and nothing else); logs and progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from app.protocol import DEFAULT_MAX_TOKENS


def _cmd_model(args: argparse.Namespace) -> int:
    from engine.builtin import write_builtin_model

    path = write_builtin_model(args.dir, size=args.size, architecture=args.architecture)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(
        EngineConfig(
            model_dir=args.model,
            dtype=args.dtype,
            cache=CacheConfig(
                kv_cache_bytes=args.kv_cache_mb * 1024 * 1024, kv_cache_dtype=args.kv_cache_dtype
            ),
            quantization=args.quantization,
            num_threads=args.num_threads,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
        )
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    try:
        outputs = engine.generate(args.prompt, params, progress=sys.stderr.isatty())
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"outputs": [o.to_dict() for o in outputs]}))
    else:
        for output in outputs:
            print(output.text)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="write a built-in random-weight model (HF format)")
    model.add_argument("size", choices=["tiny", "small"])
    model.add_argument("dir")
    model.add_argument(
        "--architecture", default="llama", choices=["llama", "llama3", "qwen2", "mistral"]
    )

    gen = sub.add_parser("generate", help="generate offline with the engine")
    gen.add_argument("--model", default="tiny", help="model directory or built-in name")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--kv-cache-mb", type=int, default=256)
    gen.add_argument(
        "--quantization", default=None, choices=["fp8"], help="fp8: FP8 weights, per-channel"
    )
    gen.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: FP8 KV cache"
    )
    gen.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="ranks (CPU worker processes, or GPUs) the model is sharded over",
    )
    gen.add_argument(
        "--num-threads", type=_positive_int, default=None, help="torch threads per rank"
    )
    gen.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (cuda)"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    # `pdserve bench ...` goes to bench.cli before parsing; listed here for `pdserve --help`
    sub.add_parser("bench", help="benchmarks: `pdserve bench --help` lists them")
    # `pdserve batch ...` likewise goes to app.batch.cli
    sub.add_parser("batch", help="batch jobs: `pdserve batch submit in.jsonl --wait`")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["batch"]:
        from app.batch.cli import main as batch_main

        return batch_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "model":
            return _cmd_model(args)
        return _cmd_generate(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: a message, not a traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
