"""`pdserve bench engine`: our engine against `transformers` generate and against the machine's
limits, same prompts, one run.

Both sides get the same random prompts (token ids), the same dtype, batch and torch
threads, greedy decoding with EOS ignored so every sequence produces exactly `--output-len`
tokens. Prefill rate: prompt tokens / time to the first token of the whole batch. Decode
rate: tokens after the first / the rest of the time. With `--repeats N` the two sides and
the machine measurements (`bench.offline.roofline`) alternate N times and the medians are reported
(the limits: the best of the N). `tokens_match`: rows whose tokens equal `transformers`'
(float32 must match all). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from bench.offline.roofline import MachineRates, measure_rates, roofline
from engine.kernels import gemm_bf16
from engine.kernels.cpu_info import cpu_info

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Run:
    prefill_s: float
    decode_s: float
    token_ids: list[list[int]]  # per prompt, the generated tokens


def make_prompts(batch: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random byte-range token ids (valid for every tokenizer's low ids)."""
    gen = torch.Generator().manual_seed(seed)
    high = min(vocab, 256)
    return torch.randint(0, high, (batch, input_len), generator=gen).tolist()


def make_engine(model_dir: str, dtype: str, prompts: list[list[int]], kv_cache_mb: int) -> Engine:
    """An engine that prefills the whole batch in one step and then decodes it together."""
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
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
    return engine


def run_pdserve(engine: Engine, prompts: list[list[int]], output_len: int) -> Run:
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    request_ids = []
    for prompt in prompts:
        request = engine.make_request(prompt, params)
        request_ids.append(request.request_id)
        engine.add_request(request)
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    total = len(prompts) * output_len
    bar = tqdm(total=total, desc="pdserve", file=sys.stderr)
    start = time.perf_counter()
    first_token_at = None
    produced = 0
    while engine.has_unfinished:
        deltas = engine.step()
        for delta in deltas:
            tokens[delta.request_id] += delta.new_token_ids
            produced += len(delta.new_token_ids)
            bar.update(len(delta.new_token_ids))
        if first_token_at is None and produced >= len(prompts):
            first_token_at = time.perf_counter()
    end = time.perf_counter()
    bar.close()
    assert first_token_at is not None and produced == total
    assert engine.kv_manager.num_free_blocks == engine.kv_spec.num_blocks
    return Run(first_token_at - start, end - first_token_at, [tokens[r] for r in request_ids])


class TransformersSide:
    """`transformers`' `generate` on the same prompts: a 1-token run times prefill, a full
    run the whole; decode is their difference."""

    def __init__(self, model_dir: str, dtype: str, prompts: list[list[int]]) -> None:
        from transformers import AutoModelForCausalLM

        from engine.kv_cache import TORCH_DTYPES

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()
        model.generation_config.eos_token_id = None  # every row generates exactly output_len
        self.model = model
        self.ids = torch.tensor(prompts)
        self.pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self._generate(2)  # warm up

    def _generate(self, max_new: int) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                self.ids,
                attention_mask=torch.ones_like(self.ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self.pad,
            )
        assert out.shape[1] == self.ids.shape[1] + max_new
        return time.perf_counter() - start, out

    def run(self, output_len: int) -> Run:
        with tqdm(total=2, desc="transformers", file=sys.stderr) as bar:
            prefill_s, _ = self._generate(1)
            bar.update(1)
            full_s, out = self._generate(output_len)
            bar.update(1)
        return Run(prefill_s, full_s - prefill_s, out[:, self.ids.shape[1] :].tolist())


def rates_of(runs: list[Run], num_prompt_tokens: int, num_decode_tokens: int) -> dict[str, float]:
    """Median prefill and decode tok/s of `runs`."""
    return {
        "prefill_tok_s": statistics.median(num_prompt_tokens / r.prefill_s for r in runs),
        "decode_tok_s": statistics.median(num_decode_tokens / r.decode_s for r in runs),
    }


def cpu_flags() -> list[str]:
    """The instruction-set flags the engine's CPU kernels care about."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return [f for f in wanted if f in cpu_info().flags]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__)
    parser.add_argument("--model", default="small", help="model directory or built-in name")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds (medians)")
    parser.add_argument("--skip-hf", action="store_true", help="only measure pdserve")
    parser.add_argument(
        "--profile", action="store_true", help="op tables of a prefill and a decode step"
    )
    parser.add_argument("--json", action="store_true", help="(the JSON line is always printed)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.builtin import resolve_model_dir
    from engine.loader import load_model_config

    model_dir = str(resolve_model_dir(args.model))
    config = load_model_config(model_dir, args.dtype)
    prompts = make_prompts(args.batch, args.input_len, config.vocab_size)
    num_prompt_tokens = args.batch * args.input_len
    num_decode_tokens = args.batch * (args.output_len - 1)
    engine = make_engine(model_dir, args.dtype, prompts, args.kv_cache_mb)
    hf = None if args.skip_hf else TransformersSide(model_dir, args.dtype, prompts)
    ours: list[Run] = []
    theirs: list[Run] = []
    measured: list[MachineRates] = []
    for _ in range(args.repeats):
        ours.append(run_pdserve(engine, prompts, args.output_len))
        if hf is not None:
            theirs.append(hf.run(args.output_len))
        measured.append(measure_rates(config, gemm_rows=num_prompt_tokens))
    rates = MachineRates(
        bandwidth_bytes_s=max(m.bandwidth_bytes_s for m in measured),
        gemm_flop_s=max(m.gemm_flop_s for m in measured),
    )
    bound = roofline(config, rates, args.batch, args.input_len, args.output_len)
    pd = rates_of(ours, num_prompt_tokens, num_decode_tokens)
    result: dict[str, Any] = {
        "model": model_dir,
        "dtype": args.dtype,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "cpu": cpu_info().model_name,
        "cpu_flags": cpu_flags(),
        # which bfloat16 GEMM the projections ran ("amx", "avx512"; None: oneDNN)
        "bf16_gemm": gemm_bf16.kernel_name() if args.dtype == "bfloat16" else None,
        "pdserve_decode_tok_s": round(pd["decode_tok_s"], 2),
        "pdserve_prefill_tok_s": round(pd["prefill_tok_s"], 2),
        "bandwidth_gb_s": round(rates.bandwidth_bytes_s / 1e9, 2),
        "gemm_gflop_s": round(rates.gemm_flop_s / 1e9, 1),
        "decode_bytes_per_step": bound.decode_bytes_per_step,
        "roofline_decode_tok_s": round(bound.decode_tok_s, 2),
        "roofline_decode_bound": bound.decode_bound,
        "roofline_prefill_tok_s": round(bound.prefill_tok_s, 2),
        "roofline_share": round(pd["decode_tok_s"] / bound.decode_tok_s, 3),
        "pdserve_decode_runs": [round(num_decode_tokens / r.decode_s, 2) for r in ours],
    }
    if theirs:
        hf_rates = rates_of(theirs, num_prompt_tokens, num_decode_tokens)
        result.update(
            hf_decode_tok_s=round(hf_rates["decode_tok_s"], 2),
            hf_prefill_tok_s=round(hf_rates["prefill_tok_s"], 2),
            ratio=round(pd["decode_tok_s"] / hf_rates["decode_tok_s"], 3),
            prefill_ratio=round(pd["prefill_tok_s"] / hf_rates["prefill_tok_s"], 3),
            hf_decode_runs=[round(num_decode_tokens / r.decode_s, 2) for r in theirs],
            tokens_match=sum(
                a == b for a, b in zip(ours[-1].token_ids, theirs[-1].token_ids, strict=True)
            )
            / args.batch,
        )
    if args.profile:
        from bench.offline.step_profile import profile_steps

        result["profile"] = profile_steps(engine, prompts)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    raise SystemExit(main())
