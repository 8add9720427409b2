"""`pdserve bench engine`: our engine against `transformers` generate, same prompts, one run.

Both sides get the same random prompts (token ids), the same dtype and batch, greedy
decoding with EOS ignored so every sequence produces exactly `--output-len` tokens.
Prefill rate: prompt tokens / time to the first token of the whole batch. Decode rate:
tokens after the first / the rest of the time. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)


def make_prompts(batch: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random byte-range token ids (valid for every tokenizer's low ids)."""
    gen = torch.Generator().manual_seed(seed)
    high = min(vocab, 256)
    return torch.randint(0, high, (batch, input_len), generator=gen).tolist()


def bench_pdserve(
    model_dir: str, dtype: str, prompts: list[list[int]], output_len: int, kv_cache_mb: int
) -> dict[str, float]:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    num_tokens = sum(len(p) for p in prompts)
    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            dtype=dtype,
            cache=CacheConfig(
                kv_cache_bytes=kv_cache_mb * 1024 * 1024, enable_prefix_caching=False
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max(2048, num_tokens),
                max_num_seqs=len(prompts),
                long_prefill_token_threshold=max(len(p) for p in prompts),
            ),
        )
    )
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
    for prompt in prompts:
        engine.add_request(engine.make_request(prompt, params))
    total = len(prompts) * output_len
    bar = tqdm(total=total, desc="pdserve", file=sys.stderr)
    start = time.perf_counter()
    first_token_at = None
    produced = 0
    while engine.has_unfinished:
        deltas = engine.step()
        produced += sum(len(d.new_token_ids) for d in deltas)
        bar.update(sum(len(d.new_token_ids) for d in deltas))
        if first_token_at is None and produced >= len(prompts):
            first_token_at = time.perf_counter()
    end = time.perf_counter()
    bar.close()
    assert first_token_at is not None and produced == total
    assert engine.kv_manager.num_free_blocks == engine.kv_spec.num_blocks
    prefill_s = first_token_at - start
    decode_s = end - first_token_at
    return {
        "prefill_tok_s": num_tokens / prefill_s,
        "decode_tok_s": len(prompts) * (output_len - 1) / decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
    }


def bench_transformers(
    model_dir: str, dtype: str, prompts: list[list[int]], output_len: int
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from engine.kv_cache import TORCH_DTYPES

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None  # every row generates exactly output_len
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(max_new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
        assert out.shape[1] == ids.shape[1] + max_new
        return time.perf_counter() - start

    run(2)  # warm up
    with tqdm(total=2, desc="transformers", file=sys.stderr) as bar:
        prefill_s = run(1)
        bar.update(1)
        full_s = run(output_len)
        bar.update(1)
    decode_s = full_s - prefill_s
    return {
        "prefill_tok_s": ids.numel() / prefill_s,
        "decode_tok_s": len(prompts) * (output_len - 1) / decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__)
    parser.add_argument("--model", default="small", help="model directory or built-in name")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--skip-hf", action="store_true", help="only measure pdserve")
    parser.add_argument("--json", action="store_true", help="(the JSON line is always printed)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.builtin import resolve_model_dir
    from engine.loader import load_model_config

    model_dir = str(resolve_model_dir(args.model))
    vocab = load_model_config(model_dir).vocab_size
    prompts = make_prompts(args.batch, args.input_len, vocab)
    ours = bench_pdserve(model_dir, args.dtype, prompts, args.output_len, args.kv_cache_mb)
    result: dict[str, object] = {
        "model": model_dir,
        "dtype": args.dtype,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads": torch.get_num_threads(),
        "pdserve_decode_tok_s": round(ours["decode_tok_s"], 2),
        "pdserve_prefill_tok_s": round(ours["prefill_tok_s"], 2),
    }
    if not args.skip_hf:
        hf = bench_transformers(model_dir, args.dtype, prompts, args.output_len)
        result.update(
            hf_decode_tok_s=round(hf["decode_tok_s"], 2),
            hf_prefill_tok_s=round(hf["prefill_tok_s"], 2),
            ratio=round(ours["decode_tok_s"] / hf["decode_tok_s"], 3),
            prefill_ratio=round(ours["prefill_tok_s"] / hf["prefill_tok_s"], 3),
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    raise SystemExit(main())
