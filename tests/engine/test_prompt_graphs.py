"""Steps holding a prompt through `engine.prompt_graphs`: padded to a token count, split
around attention. The padded path gives the eager engine's tokens (prompts of every bucket,
chunked prompts, mixed steps), writes K/V only into its requests' slots, calls a layer hook
after each layer's K/V is written, and leaves the block pool empty.

On the CPU the padded path runs without capture (`Engine(..., prompt_graphs=True)`); the
`gpu` test captures real CUDA graphs against the eager engine.
"""

from __future__ import annotations

import pytest
import torch

from app.config import ModelSettings
from engine.builtin import write_builtin_model
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.prompt_graphs import PromptGraphs, token_buckets, uses_prompt_graphs
from engine.request import SamplingParams

CUDA = torch.cuda.is_available()
# Lengths on both sides of bucket edges (16, 32, 64, 128), one longer than a step's budget.
PROMPT_LENGTHS = (1, 15, 16, 17, 33, 100, 250)
BUDGET = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_builtin_model(tmp_path_factory.mktemp("tiny"), "tiny"))


def make_engine(model_dir: str, device: str, prompt_graphs: bool) -> Engine:
    config = EngineConfig(
        model_dir=model_dir,
        device=device,
        cache=CacheConfig(kv_cache_bytes=1 << 21, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=8),
        enforce_eager=True,  # decode steps eager on both sides: only prompt steps differ
    )
    return Engine(config, prompt_graphs=prompt_graphs)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def generate(engine: Engine, token_prompts: list[list[int]]) -> list[list[int]]:
    params = [
        SamplingParams(max_tokens=5 + i, temperature=0.0, ignore_eos=True)
        for i in range(len(token_prompts))
    ]
    return [o.token_ids for o in engine.generate(token_prompts, params)]


def written_slots(engine: Engine) -> torch.Tensor:
    """[num_blocks, block_size] bool: the slots any layer's K or V was written in."""
    return engine.kv_cache.flat.ne(0).any(dim=-1).any(dim=-1).any(dim=0).any(dim=0).cpu()


def test_padded_prompt_steps_give_the_eager_tokens(model_dir: str) -> None:
    eager = make_engine(model_dir, "cpu", prompt_graphs=False)
    padded = make_engine(model_dir, "cpu", prompt_graphs=True)
    token_prompts = prompts()
    assert generate(padded, token_prompts) == generate(eager, token_prompts)
    graphs = padded.runner.prompt_graphs
    assert graphs is not None and eager.runner.prompt_graphs is None
    # chunked (250 > the budget) and mixed (decodes beside a chunk) steps took the path
    assert graphs.num_replays >= 3
    assert graphs.token_counts == (16, 32, 64, 128)
    # padding rows write nothing: the same slots hold K/V on both sides
    assert torch.equal(written_slots(padded), written_slots(eager))
    assert padded.kv_manager.num_free_blocks == padded.kv_manager.pool.num_blocks


def test_each_prompt_alone_in_a_step(model_dir: str) -> None:
    """One request per step: every bucket and its edges, the padding at its largest."""
    eager = make_engine(model_dir, "cpu", prompt_graphs=False)
    padded = make_engine(model_dir, "cpu", prompt_graphs=True)
    for prompt in prompts():
        assert generate(padded, [prompt]) == generate(eager, [prompt])


def test_hidden_states_match_the_eager_model(model_dir: str) -> None:
    """The padded step's hidden rows against the eager model's on the same step (the GEMMs
    see more rows, so equal to float32 rounding, not bit for bit)."""
    engine = make_engine(model_dir, "cpu", prompt_graphs=False)
    graphs = PromptGraphs(engine.model, engine.kv_cache, (16, 64))
    prompt = prompts()[4]  # 33 tokens: padded to 64
    engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=1)))
    output = engine.scheduler.schedule()
    model_input = engine.runner.prepare(output)
    ids, positions, metadata = model_input.input_ids, model_input.positions, model_input.metadata
    assert graphs.can_run(ids.shape[0], metadata)
    expected = engine.model(ids, positions, engine.kv_cache, metadata).clone()
    hooked: list[int] = []
    hidden = graphs.run(ids, positions, metadata, hooked.append)
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    assert hooked == list(range(engine.model_config.num_hidden_layers))


def test_layer_hook_sees_each_layer_written(model_dir: str) -> None:
    """When the hook runs for layer i, layer i's K/V of the step are in the cache (the
    prefill replica streams them out from there), and later layers' are not yet."""
    engine = make_engine(model_dir, "cpu", prompt_graphs=True)
    engine.add_request(engine.make_request(prompts()[3], SamplingParams(max_tokens=1)))
    layers_written: list[list[bool]] = []

    def hook(layer: int) -> None:
        # flat: [layers, 2 (K, V), blocks, block_size, heads, head_dim]
        per_layer = engine.kv_cache.flat.ne(0).flatten(2).any(dim=2)  # [layers, 2]
        layers_written.append(per_layer.all(dim=1).tolist())

    engine.step(layer_hook_for=lambda output: hook)
    num_layers = engine.model_config.num_hidden_layers
    assert len(layers_written) == num_layers
    for layer, written in enumerate(layers_written):
        assert written == [i <= layer for i in range(num_layers)]


def test_decode_only_and_oversized_steps_stay_eager(model_dir: str) -> None:
    engine = make_engine(model_dir, "cpu", prompt_graphs=True)
    graphs = engine.runner.prompt_graphs
    assert graphs is not None
    engine.add_request(engine.make_request([5] * 10, SamplingParams(max_tokens=4)))
    engine.step()  # the prompt
    replays = graphs.num_replays
    while engine.has_unfinished:
        engine.step()  # decode-only steps
    assert graphs.num_replays == replays == 1
    engine.add_request(engine.make_request([5] * 10, SamplingParams(max_tokens=1)))
    output = engine.scheduler.schedule()
    metadata = engine.runner.prepare(output).metadata
    assert not graphs.can_run(graphs.max_tokens + 1, metadata)
    assert graphs.can_run(10, metadata)


def test_token_buckets_and_when_they_are_used() -> None:
    def config(budget: int, **kwargs: object) -> EngineConfig:
        scheduler = SchedulerConfig(max_num_batched_tokens=budget)
        return EngineConfig(model_dir="tiny", scheduler=scheduler, **kwargs)  # type: ignore[arg-type]

    ladder = (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert token_buckets(config(2048)) == ladder
    assert token_buckets(config(8192)) == ladder
    assert token_buckets(config(600)) == (16, 32, 64, 128, 256, 512, 600)
    assert token_buckets(config(100)) == (16, 32, 64, 100)
    assert token_buckets(config(8)) == (8,)
    on = {"prompt_cuda_graphs": True}
    assert not uses_prompt_graphs(config(2048))  # off by default
    assert not uses_prompt_graphs(config(2048, **on))  # the CPU
    assert uses_prompt_graphs(config(2048, device="cuda", **on))
    assert not uses_prompt_graphs(config(2048, device="cuda", tensor_parallel_size=2, **on))
    settings = ModelSettings(model="tiny", prompt_cuda_graphs=True)
    assert settings.to_engine_config().prompt_cuda_graphs


def test_a_step_that_would_pad_much_runs_eagerly(model_dir: str) -> None:
    engine = make_engine(model_dir, "cpu", prompt_graphs=False)
    graphs = PromptGraphs(engine.model, engine.kv_cache, (16, 512, 768))
    engine.add_request(engine.make_request([5] * 10, SamplingParams(max_tokens=1)))
    metadata = engine.runner.prepare(engine.scheduler.schedule()).metadata
    assert graphs.can_run(1, metadata)  # 15 of padding: small in itself
    assert graphs.can_run(650, metadata)  # 118 of padding, under a quarter of 650
    assert not graphs.can_run(513, metadata)  # 255 of padding: more than a quarter


def cuda_engine(model_dir: str, dtype: str, prompt_graphs: bool) -> Engine:
    """Decode graphs on and prefix caching on, as a decode replica runs: prompt graphs
    beside them, shared prefixes attended from the cache."""
    config = EngineConfig(
        model_dir=model_dir,
        device="cuda",
        dtype=dtype,
        cache=CacheConfig(kv_cache_bytes=1 << 22, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=8),
    )
    return Engine(config, prompt_graphs=prompt_graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_captured_prompt_graphs_give_the_eager_tokens(model_dir: str) -> None:
    eager = cuda_engine(model_dir, "float32", prompt_graphs=False)
    captured = cuda_engine(model_dir, "float32", prompt_graphs=True)
    shared = prompts()[5][:40]  # later prompts start with it: cached blocks attended
    token_prompts = [*prompts(), shared + [7] * 30, shared + [9] * 50]
    for batch in (token_prompts[:7], token_prompts[7:]):
        assert generate(captured, batch) == generate(eager, batch)
    graphs = captured.runner.prompt_graphs
    assert graphs is not None and graphs.capture and graphs.num_replays >= 4
    assert set(graphs._graphs) == set(graphs.token_counts)  # every count captured
    assert captured.runner.graphs is not None and captured.runner.graphs.num_replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_captured_bfloat16_step_matches_the_eager_model(model_dir: str) -> None:
    """bfloat16 runs the Triton norm and RoPE kernels under capture; the layer hook runs
    between the graphs. Hidden rows equal the eager model's to bfloat16's precision."""
    engine = cuda_engine(model_dir, "bfloat16", prompt_graphs=True)
    graphs = engine.runner.prompt_graphs
    assert graphs is not None and graphs.capture
    engine.add_request(engine.make_request(prompts()[4], SamplingParams(max_tokens=1)))
    model_input = engine.runner.prepare(engine.scheduler.schedule())
    ids, positions, metadata = model_input.input_ids, model_input.positions, model_input.metadata
    hooked: list[int] = []
    hidden = graphs.run(ids, positions, metadata, hooked.append).clone()
    expected = engine.model(ids, positions, engine.kv_cache, metadata)
    torch.testing.assert_close(hidden, expected, rtol=2e-2, atol=2e-2)
    assert hooked == list(range(engine.model_config.num_hidden_layers))
