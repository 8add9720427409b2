"""Decode steps through `engine.cuda_graphs`: the padded static path gives the eager
engine's tokens, writes K/V only into its requests' slots (and the scratch block), and
leaves the block pool empty.

On the CPU the padded path runs without capture (`Engine(..., decode_graphs=True)`); the
`gpu` test captures real CUDA graphs (the default on cuda) against `enforce_eager`.

Why the KV is compared byte for byte only without padding (batch 1, CPU): a padded step
multiplies `B` rows where the eager one multiplies `n`, and GEMMs round the same row
differently for different row counts, in the last bit (measured: MKL's kernels for 1-3
rows; cuBLAS may too). Which slots get written is compared exactly; a padding row writing
a real slot would put its own token's K/V there, off by far more than the tolerance.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from app.cli import main as cli_main
from app.config import ModelSettings
from engine.builtin import write_builtin_model
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.cuda_graphs import capture_sizes, default_batch_sizes
from engine.engine import Engine
from engine.request import SamplingParams

SIZES = (1, 2, 4, 8)
PROMPTS = [
    "hello",
    "a prompt long enough to span more than one KV block of sixteen tokens, and then some",
    "xyz",
    "Ünïcödé and emoji 🚀",
    "a medium-length prompt of a few words",
]
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny"))


def make_engine(model_dir: str, device: str, graphs: bool) -> Engine:
    """An engine with 128 KV blocks; on the CPU `graphs` asks for the uncaptured padded
    path, on cuda it is the default (captured) against `enforce_eager`."""
    config = EngineConfig(
        model_dir=model_dir,
        device=device,
        cache=CacheConfig(kv_cache_bytes=1 << 20, enable_prefix_caching=False),
        cuda_graph_batch_sizes=SIZES,
        enforce_eager=not graphs,
    )
    return Engine(config, decode_graphs=graphs if device == "cpu" else None)


def generate(engine: Engine, num_requests: int) -> list[list[int]]:
    """Greedy, each request a different length, so the batch shrinks as they finish."""
    params = [
        SamplingParams(max_tokens=6 + 7 * i, temperature=0.0, ignore_eos=True)
        for i in range(num_requests)
    ]
    return [o.token_ids for o in engine.generate(PROMPTS[:num_requests], params)]


def written_slots(engine: Engine) -> torch.Tensor:
    """[num_blocks, block_size] bool: the slots any layer's K or V was written in (a fresh
    cache is zeros)."""
    return engine.kv_cache.flat.ne(0).any(dim=-1).any(dim=-1).any(dim=0).any(dim=0).cpu()


def check_against_eager(eager: Engine, padded: Engine, num_requests: int) -> None:
    expected = generate(eager, num_requests)
    assert generate(padded, num_requests) == expected
    graphs = padded.runner.graphs
    assert graphs is not None and eager.runner.graphs is None
    assert graphs.num_replays > 0
    scratch = graphs.scratch_block
    assert scratch == padded.kv_spec.num_blocks - 1
    written_eager, written_padded = written_slots(eager), written_slots(padded)
    assert not written_eager[scratch].any()  # the eager run never reached the last block
    assert torch.equal(written_padded[:scratch], written_eager[:scratch])
    if num_requests not in SIZES:
        assert written_padded[scratch].any()  # the padding rows' K/V went there
    real = slice(0, scratch)
    got = padded.kv_cache.flat[:, :, real].float().cpu()
    want = eager.kv_cache.flat[:, :, real].float().cpu()
    if num_requests == 1 and not graphs.capture:  # no padding: the very same arithmetic
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for engine in (eager, padded):
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    assert padded.kv_manager.pool.num_blocks == eager.kv_manager.pool.num_blocks - 1


@pytest.mark.parametrize("num_requests", [1, 3, 5])
def test_padded_decode_matches_eager_on_cpu(model_dir: str, num_requests: int) -> None:
    eager = make_engine(model_dir, "cpu", graphs=False)
    padded = make_engine(model_dir, "cpu", graphs=True)
    check_against_eager(eager, padded, num_requests)


def test_batches_above_the_largest_size_run_eagerly(model_dir: str) -> None:
    eager = make_engine(model_dir, "cpu", graphs=False)
    padded = make_engine(model_dir, "cpu", graphs=True)
    prompts = [f"request number {i}" for i in range(SIZES[-1] + 2)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in padded.generate(prompts, params)] == expected
    assert padded.runner.graphs is not None and padded.runner.graphs.num_replays == 0


def test_a_cache_without_room_for_the_scratch_block_is_refused(model_dir: str) -> None:
    probe = make_engine(model_dir, "cpu", graphs=False)
    config = EngineConfig(
        model_dir=model_dir, cache=CacheConfig(kv_cache_bytes=probe.kv_spec.bytes_per_block)
    )
    with pytest.raises(ValueError, match="scratch block"):
        Engine(config, decode_graphs=True)


def test_default_sizes_and_config_validation() -> None:
    assert default_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_batch_sizes(3) == (1, 2, 3)
    config = EngineConfig(model_dir="tiny", cuda_graph_batch_sizes=(64, 1, 8))
    assert capture_sizes(replace(config, scheduler=SchedulerConfig(max_num_seqs=32))) == (1, 8)
    config = replace(config, cuda_graph_batch_sizes=(64,))
    assert capture_sizes(replace(config, scheduler=SchedulerConfig(max_num_seqs=32))) == (32,)
    settings = ModelSettings(enforce_eager=True, cuda_graph_batch_sizes=[8, 1, 4])
    engine_config = settings.to_engine_config()
    assert engine_config.enforce_eager and engine_config.cuda_graph_batch_sizes == (8, 1, 4)
    for bad, message in (([], "at least one"), ([0, 2], "1..4096"), ([2, 2], "repeated")):
        with pytest.raises(ValidationError, match=message):
            ModelSettings(cuda_graph_batch_sizes=bad)
    with pytest.raises(ValidationError, match="Extra inputs"):
        ModelSettings(enforce_eagerly=True)  # type: ignore[call-arg]


def test_generate_cli_takes_enforce_eager(
    model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", model_dir, "--prompt", "hi", "--max-tokens", "3"]
    assert cli_main([*argv, "--enforce-eager", "--json"]) == 0
    assert '"outputs"' in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("num_requests", [1, 3, 5])
def test_captured_graphs_match_eager_on_cuda(model_dir: str, num_requests: int) -> None:
    eager = make_engine(model_dir, "cuda", graphs=False)
    graphed = make_engine(model_dir, "cuda", graphs=True)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.capture
    check_against_eager(eager, graphed, num_requests)
