"""The CUDA engine (Triton kernels, with and without decode graphs) against `transformers`:
token for token in float32, close in bfloat16. Skipped without CUDA; run by
scripts/gpu_check.sh. `transformers` runs on the CPU in float32: the ground truth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.offline.accuracy import make_engine, teacher_forced_logits
from engine.builtin import write_builtin_model
from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_engine_vs_hf import MAX_TOKENS, PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp(request.param), "tiny", request.param)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_float32_matches_transformers(model_dir: Path, enforce_eager: bool) -> None:
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    engine = Engine(
        EngineConfig(
            model_dir=str(model_dir), dtype="float32", device="cuda", enforce_eager=enforce_eager
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == expected
    graphs = engine.runner.graphs
    assert (graphs is None) == enforce_eager
    if graphs is not None:
        assert graphs.num_replays > 0  # the decode steps took the captured path


def test_bfloat16_is_close_to_transformers_float32(model_dir: Path) -> None:
    engine = make_engine(str(model_dir), "bfloat16", None, "auto", 256, device="cuda")
    ids = engine.tokenize(PROMPTS[1] + " " + PROMPTS[2])
    got = teacher_forced_logits(engine, ids).cpu()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    # The CPU bf16 engine measures 0.037 / 0.94 (llama) and 0.035 / 0.95 (qwen2) here: the
    # random `tiny` amplifies bf16 rounding. A wrong kernel is off by order 1.
    assert rel.mean() < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
