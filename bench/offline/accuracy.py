"""`pdserve bench accuracy`: FP8 (weights and/or KV cache) against full precision.

The full-precision engine (`--dtype`, no FP8) generates `--tokens` greedy tokens after a
fixed prompt; that trajectory is the reference. Each candidate engine (the requested FP8
settings, and with both on, each alone) then reads the same prompt + trajectory in one
teacher-forced pass (its own weights, its own KV cache written and read back, so FP8 KV
is in the loop) and its logits at every trajectory position are compared with the
reference's:

- `rel_logit_error`: `||l_fp8 - l_ref||_2 / ||l_ref||_2` per position (mean, p99, max);
- `max_abs_logit_error`: the largest single logit difference;
- `greedy_agreement`: the share of positions where the candidate's top token is the
  reference's greedy token (so: would greedy decoding have continued identically here);
- `free_running`: the candidate also generates freely from the prompt; tokens equal to the
  reference's before the first difference, and the share equal position by position.

The last stdout line is one JSON object (also written to `--json PATH`).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.kernels.metadata import AttentionMetadata
from engine.request import SamplingParams

logger = logging.getLogger(__name__)

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention keeps KV in blocks."


def make_engine(
    model: str,
    dtype: str,
    quantization: str | None,
    kv_cache_dtype: str,
    num_tokens: int,
    device: str = "cpu",
) -> Engine:
    """An engine whose cache and step budget hold one sequence of `num_tokens`."""
    block_size = 16
    return Engine(
        EngineConfig(
            model_dir=model,
            dtype=dtype,
            device=device,
            quantization=quantization,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_bytes=_cache_bytes(model, dtype, num_tokens + block_size),
                enable_prefix_caching=False,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max(2048, num_tokens),
                max_num_seqs=1,
                long_prefill_token_threshold=max(512, num_tokens),
            ),
        )
    )


def _cache_bytes(model: str, dtype: str, num_tokens: int) -> int:
    from engine.builtin import resolve_model_dir
    from engine.loader import load_model_config

    config = load_model_config(resolve_model_dir(model), dtype)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    return per_token * num_tokens


def teacher_forced_logits(engine: Engine, token_ids: Sequence[int]) -> torch.Tensor:
    """Float32 logits `[len(token_ids), vocab]` of one prefill pass over `token_ids`
    (the engine's own KV cache is written and read, blocks 0.. in order)."""
    num_tokens = len(token_ids)
    block_size = engine.kv_spec.block_size
    num_blocks = -(-num_tokens // block_size)
    if num_blocks > engine.kv_spec.num_blocks:
        raise ValueError(f"{num_tokens} tokens do not fit the engine's KV cache")
    device = engine.device
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], device=device),
        seq_lens=torch.tensor([num_tokens], device=device),
        block_tables=torch.arange(num_blocks, device=device)[None],
        query_lens_list=(num_tokens,),
        seq_lens_list=(num_tokens,),
        block_size=block_size,
    )
    ids = torch.tensor(list(token_ids), device=device)
    hidden = engine.model(
        ids, torch.arange(num_tokens, device=device), engine.runner.kv_cache, metadata
    )
    return engine.model.compute_logits(hidden).float()


def greedy(engine: Engine, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """`num_tokens` greedy tokens after `prompt_ids` (EOS ignored)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt_ids], params)[0].token_ids


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor, targets: list[int]) -> dict:
    """Error of `candidate` logits against `reference` (`[n, vocab]` each) and agreement of
    the candidate's top token with `targets` (the reference's greedy tokens)."""
    diff = candidate - reference
    rel = diff.norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-12)
    agree = candidate.argmax(dim=-1) == torch.tensor(targets)
    return {
        "rel_logit_error_mean": round(float(rel.mean()), 6),
        "rel_logit_error_p99": round(float(rel.quantile(0.99)), 6),
        "rel_logit_error_max": round(float(rel.max()), 6),
        "max_abs_logit_error": round(float(diff.abs().max()), 6),
        "greedy_agreement": round(float(agree.float().mean()), 6),
    }


def free_running(reference: list[int], candidate: list[int]) -> dict:
    """How long `candidate` follows `reference`, and how often they agree position-wise."""
    prefix = next(
        (i for i, (a, b) in enumerate(zip(reference, candidate, strict=True)) if a != b),
        len(reference),
    )
    same = sum(a == b for a, b in zip(reference, candidate, strict=True))
    return {"matched_prefix": prefix, "position_agreement": round(same / len(reference), 6)}


Candidate = tuple[str, str | None, str]  # (dtype, quantization, kv_cache_dtype)


def measure(
    model: str,
    dtype: str,
    candidates: Sequence[Candidate],
    num_tokens: int,
    free_tokens: int,
    prompt: str = PROMPT,
    device: str = "cpu",
) -> dict:
    """Compare each candidate engine with the full-precision engine in `dtype`."""
    start = time.perf_counter()
    reference_engine = make_engine(model, dtype, None, "auto", num_tokens + 256, device)
    prompt_ids = reference_engine.tokenize(prompt)
    trajectory = greedy(reference_engine, prompt_ids, num_tokens)
    sequence = prompt_ids + trajectory[:-1]  # position p predicts trajectory[p - len(prompt)]
    positions = slice(len(prompt_ids) - 1, len(sequence))
    ref_logits = teacher_forced_logits(reference_engine, sequence)[positions].cpu()
    del reference_engine
    results = []
    for candidate_dtype, quantization, kv_cache_dtype in candidates:
        engine = make_engine(
            model, candidate_dtype, quantization, kv_cache_dtype, num_tokens + 256, device
        )
        logits = teacher_forced_logits(engine, sequence)[positions].cpu()
        row: dict[str, object] = {
            "dtype": candidate_dtype,
            "quantization": quantization,
            "kv_cache_dtype": kv_cache_dtype,
        }
        row.update(compare_logits(ref_logits, logits, trajectory))
        if free_tokens:
            own = greedy(engine, prompt_ids, free_tokens)
            row["free_running"] = free_running(trajectory[:free_tokens], own)
        results.append(row)
        logger.info("%s", row)
    return {
        "model": model,
        "dtype": dtype,
        "device": device,
        "tokens": num_tokens,
        "prompt_tokens": len(prompt_ids),
        "free_running_tokens": free_tokens,
        "results": results,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench accuracy", description=__doc__)
    parser.add_argument("--model", default="small", help="model directory or built-in name")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--candidate-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the FP8 engines (default --dtype)",
    )
    parser.add_argument(
        "--baseline-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="also compare the plain engine in this dtype (e.g. bfloat16: how much of the "
        "error any rounding causes on this model)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quantization", default=None, choices=["fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--tokens", type=int, default=1024, help="reference greedy tokens")
    parser.add_argument(
        "--free-tokens", type=int, default=None, help="free-running tokens (default --tokens)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.quantization is None and args.kv_cache_dtype == "auto":
        parser.error("nothing to compare: pass --quantization fp8 and/or --kv-cache-dtype fp8")
    dtype = args.candidate_dtype or args.dtype
    candidates: list[Candidate] = [(dtype, args.quantization, args.kv_cache_dtype)]
    if args.quantization and args.kv_cache_dtype == "fp8":  # and each alone
        candidates += [(dtype, args.quantization, "auto"), (dtype, None, args.kv_cache_dtype)]
    if args.baseline_dtype is not None:
        candidates.append((args.baseline_dtype, None, "auto"))
    free = args.tokens if args.free_tokens is None else args.free_tokens
    result = measure(
        args.model,
        args.dtype,
        candidates,
        args.tokens,
        min(free, args.tokens),
        device=args.device,
    )
    text = json.dumps(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
