"""`pdserve bench tpot`: decode time per output token, CUDA graphs on and off, against the
weight-bandwidth roofline.

For each model, mode and batch size, `batch` requests of `--prompt-len` random tokens are
prefilled in one step, then decode `--output-len` tokens together (EOS ignored); TPOT is
the median time of those pure-decode steps (`Engine.step`, synchronized on CUDA: schedule,
inputs, forward, sampling, detokenizing). The roofline is the bytes one decode step must
read, every weight but the embedding table (of which it gathers `batch` rows), divided by
`--bandwidth` (default: H200 HBM3e, 4.8 TB/s); KV reads come on top (small here).

Modes: `graphs` captures decode graphs (`engine.cuda_graphs`; on the CPU the padded path
runs uncaptured), `prompt-graphs` the prompt steps' graphs too (`engine.prompt_graphs`: the
prefill step's `prefill_ms`, when its tokens fit 2,048), `eager` runs every step eagerly.
Models: a directory, a built-in name, or `llama3-8b`: the Llama-3-8B shape (hidden 4096,
32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256) with random weights
(`load_format: dummy`).

`--profile DIR`: for each row, the same batch runs again with `--profile-steps` of its
decode steps under `torch.profiler` (CPU and CUDA), and DIR gets
`<model>-<mode>-b<batch>.txt`: the ops by self CPU time and by self device time, per
step the host time, the device time and the count of kernel launches and syncs, and then
`cProfile`'s cumulative times for as many more steps (which Python code an eager step's
host time goes to).

Stdout: a table, or with `--json` one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.builtin import resolve_model_dir
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.loader import CONFIG_FILE, load_model_config
from engine.request import SamplingParams

H200_BYTES_S = 4.8e12
MODES = ("graphs", "prompt-graphs", "eager")
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
SHAPES = {"llama3-8b": LLAMA3_8B}


def shape_dir(name: str, out: Path) -> Path:
    """A model directory with `name`'s config.json and the built-in byte-level tokenizer
    (no weights: load it with `load_format: dummy`)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_source = resolve_model_dir("tiny")
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_source / file, out / file)
    (out / CONFIG_FILE).write_text(json.dumps(SHAPES[name]))
    return out


def measure(
    model: str,
    model_dir: str,
    dummy: bool,
    mode: str,
    batches: Sequence[int],
    args: argparse.Namespace,
) -> list[dict[str, object]]:
    """TPOT rows of one engine (one model in one mode), one per batch size."""
    config = load_model_config(model_dir, args.dtype)
    block = 16
    tokens_per_seq = args.prompt_len + args.output_len + block
    kv_bytes = (max(batches) * tokens_per_seq + 2 * block) * config.kv_bytes_per_token
    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            dtype=args.dtype,
            device=args.device,
            cache=CacheConfig(
                block_size=block,
                kv_cache_bytes=kv_bytes,
                kv_cache_dtype=args.kv_cache_dtype,
                enable_prefix_caching=False,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max(batches) * args.prompt_len,
                max_num_seqs=max(batches),
                long_prefill_token_threshold=args.prompt_len,
            ),
            enforce_eager=mode == "eager",
            load_format="dummy" if dummy else "auto",
            quantization=args.quantization,
        ),
        decode_graphs=mode != "eager",
        prompt_graphs=mode == "prompt-graphs",
    )
    weights = [p for name, p in engine.model.named_parameters() if not name.startswith("embed")]
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    params_count = sum(p.numel() for p in weights)  # 2 FLOPs each per prompt token
    cuda = engine.device.type == "cuda"
    rows = []
    engine.generate([[65] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    graphs, prompts = engine.runner.graphs, engine.runner.prompt_graphs
    for batch in batches:
        replays_before = graphs.num_replays if graphs is not None else 0
        prompt_before = prompts.num_replays if prompts is not None else 0
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        gen = torch.Generator().manual_seed(batch)
        for prompt in torch.randint(0, 256, (batch, args.prompt_len), generator=gen).tolist():
            engine.add_request(engine.make_request(prompt, params))
        steps = []
        while engine.has_unfinished:
            if cuda:
                torch.cuda.synchronize(engine.device)
            start = time.perf_counter()
            engine.step()
            if cuda:
                torch.cuda.synchronize(engine.device)
            steps.append(time.perf_counter() - start)
        tpot_ms = statistics.median(steps[1:]) * 1e3  # steps[0] is the batch's prefill
        prefill_s = steps[0]
        graph_steps = graphs.num_replays - replays_before if graphs is not None else 0
        prompt_steps = prompts.num_replays - prompt_before if prompts is not None else 0
        if args.profile:  # after the count: the profiled steps replay graphs too
            profile(engine, batch, args, args.profile / f"{model}-{mode}-b{batch}.txt")
        roofline_ms = weight_bytes / args.bandwidth * 1e3
        rows.append(
            {
                "model": model,
                "mode": mode,
                "quantization": args.quantization,
                "kv_cache_dtype": args.kv_cache_dtype,
                "batch": batch,
                "tpot_ms": round(tpot_ms, 4),
                "weight_gb": round(weight_bytes / 1e9, 3),
                "roofline_ms": round(roofline_ms, 4),
                "x_roofline": round(tpot_ms / roofline_ms, 2),
                "graph_steps": graph_steps,
                "prompt_graph_steps": prompt_steps,
                "prefill_tokens": batch * args.prompt_len,
                "prefill_ms": round(prefill_s * 1e3, 3),
                "prefill_tflops": round(
                    2 * params_count * batch * args.prompt_len / prefill_s / 1e12, 1
                ),
            }
        )
    engine.close()
    del engine, graphs, prompts
    gc.collect()  # the graphs' memory pool goes with them
    if cuda:
        torch.cuda.empty_cache()
    return rows


def profile(engine: Engine, batch: int, args: argparse.Namespace, out: Path) -> None:
    """Run `batch` requests again and write where `--profile-steps` decode steps (after
    the prefill and two warm steps) spend host and device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(max_tokens=2 * args.profile_steps + 3, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(engine.make_request([66] * args.prompt_len, params))
    for _ in range(3):  # the prefill and two decode steps
        engine.step()
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    wall_ms = (time.perf_counter() - start) * 1e3 / args.profile_steps
    python = cProfile.Profile()  # the same number of steps again: which Python code runs
    python.enable()
    for _ in range(args.profile_steps):
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    python.disable()
    while engine.has_unfinished:
        engine.step()
    by_function = io.StringIO()
    stats = pstats.Stats(python, stream=by_function)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    events = prof.key_averages()
    steps = args.profile_steps

    def count(*names: str) -> float:
        return sum(e.count for e in events if e.key in names) / steps

    device_us = sum(e.self_device_time_total for e in events) / steps
    lines = [
        f"{out.stem}: {steps} decode steps, per step: wall {wall_ms:.3f} ms, "
        f"device busy {device_us / 1e3:.3f} ms, "
        f"launches {count('cudaLaunchKernel', 'cuLaunchKernel', 'cuLaunchKernelEx'):.0f}, "
        f"graph launches {count('cudaGraphLaunch'):.0f}, "
        f"syncs {count('cudaStreamSynchronize', 'cudaDeviceSynchronize'):.0f}, "
        f"memcpy {count('cudaMemcpyAsync', 'cudaMemcpy'):.0f}",
        "",
        events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
    ]
    if engine.device.type == "cuda":
        lines.append(
            events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
        )
    lines += [
        f"Python functions over {steps} more steps (cProfile: cumulative, then own time):",
        by_function.getvalue(),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(lines[0], flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench tpot", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["small", "llama3-8b"])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["graphs", "eager"],
        help="graphs: decode steps as CUDA graphs; prompt-graphs: prompt steps too "
        "(engine.prompt_graphs); eager: neither",
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--bandwidth", type=float, default=H200_BYTES_S, help="bytes/s")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quantization", choices=["fp8"], help="weights (default: as loaded)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--profile", type=Path, help="write per-row profiles to this dir")
    parser.add_argument("--profile-steps", type=int, default=10)
    args = parser.parse_args(argv)
    if bad := [m for m in args.modes if m not in MODES]:
        parser.error(f"--modes takes {', '.join(MODES)}, not {bad}")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            dummy = model in SHAPES
            path = shape_dir(model, Path(tmp) / model) if dummy else resolve_model_dir(model)
            model_dir = str(path)
            for mode in args.modes:
                rows += measure(model, model_dir, dummy, mode, args.batch, args)
    if args.json:
        print(json.dumps({"device": args.device, "dtype": args.dtype, "rows": rows}))
        return 0
    print(
        f"{'model':10} {'mode':6} {'weights':7} {'kv':4} {'batch':>5} {'TPOT ms':>8} "
        f"{'weights GB':>10} {'roofline ms':>11} {'x roofline':>10} {'graph steps':>11} "
        f"{'prefill tok':>11} {'prefill ms':>10} {'TFLOP/s':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:10} {r['mode']:6} {r['quantization'] or '-':7} {r['kv_cache_dtype']:4} "
            f"{r['batch']:>5} {r['tpot_ms']:>8.3f} {r['weight_gb']:>10.3f} "
            f"{r['roofline_ms']:>11.4f} {r['x_roofline']:>10.2f} {r['graph_steps']:>11} "
            f"{r['prefill_tokens']:>11} {r['prefill_ms']:>10.2f} {r['prefill_tflops']:>7.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
