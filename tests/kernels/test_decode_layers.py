"""The fused decode path (every layer in one C call) against the layer-by-layer path: in
float32 bit for bit, the hidden states it returns and the K/V it writes into the cache; in
bfloat16 (AMX) to bfloat16's precision, and closer than the layers to exact arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.builtin import write_builtin_model
from engine.engine import Engine
from engine.kernels import decode_layers, gemm_bf16, gemm_f32
from engine.kernels.decode_layers import DecodeLayers
from engine.kernels.metadata import AttentionMetadata
from engine.kv_cache import KVCache

pytestmark = pytest.mark.skipif(decode_layers._driver() is None, reason="kernels not built here")

SEQ_LENS = (1, 5, 16, 17, 40)  # contexts after the step: inside, at and across block edges


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: projections with biases
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model_dir = write_builtin_model(tmp_path_factory.mktemp(request.param), "tiny", request.param)
    return Engine.from_model(str(model_dir), num_threads=1, dtype="float32")


def decode_step(engine: Engine) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One new token for each of `SEQ_LENS`' sequences, on distinct shuffled blocks."""
    block_size = engine.kv_spec.block_size
    per_seq = [-(-n // block_size) for n in SEQ_LENS]
    width = max(per_seq)
    ids = torch.randperm(engine.kv_spec.num_blocks)[: sum(per_seq)].tolist()
    tables = torch.zeros(len(SEQ_LENS), width, dtype=torch.int64)
    for i, count in enumerate(per_seq):
        tables[i, :count] = torch.tensor(ids[:count])
        ids = ids[count:]
    positions = torch.tensor([n - 1 for n in SEQ_LENS])
    slots = torch.stack(
        [tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(positions)]
    )
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(len(SEQ_LENS) + 1),
        seq_lens=torch.tensor(SEQ_LENS),
        block_tables=tables,
        query_lens_list=(1,) * len(SEQ_LENS),
        seq_lens_list=SEQ_LENS,
        block_size=block_size,
    )
    input_ids = torch.randint(0, engine.model.config.vocab_size, (len(SEQ_LENS),))
    return input_ids, positions, metadata


def test_fused_decode_equals_the_layers_bit_for_bit(engine: Engine) -> None:
    torch.manual_seed(0)
    model = engine.model
    filled = torch.randn(engine.kv_spec.flat_shape)  # earlier tokens' K/V
    fused_cache, layer_cache = (
        KVCache(engine.kv_spec, filled.clone()),
        KVCache(engine.kv_spec, filled.clone()),
    )
    assert DecodeLayers.build(model, fused_cache) is not None
    input_ids, positions, metadata = decode_step(engine)
    fused = model(input_ids, positions, fused_cache, metadata)
    # a layer hook takes the layer-by-layer path
    layered = model(input_ids, positions, layer_cache, metadata, layer_hook=lambda i: None)
    assert torch.equal(fused, layered)
    assert torch.equal(fused_cache.flat, layer_cache.flat)
    assert not torch.equal(fused_cache.flat, filled)  # the step's K/V were written


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny qwen2 whose float32 weights are bfloat16 values: a float32 engine on it does
    the bfloat16 engines' arithmetic exactly."""
    if not gemm_bf16.available():
        pytest.skip("the bfloat16 fused path needs AMX")
    from safetensors.torch import load_file, save_file

    model_dir = write_builtin_model(tmp_path_factory.mktemp("bf16"), "tiny", "qwen2")
    weights = model_dir / "model.safetensors"
    state = load_file(weights)
    save_file({k: v.to(torch.bfloat16).float() for k, v in state.items()}, weights)
    return str(model_dir)


@pytest.fixture(scope="module")
def bf16_engine(bf16_model_dir: str) -> Engine:
    return Engine.from_model(bf16_model_dir, num_threads=1, dtype="bfloat16")


def test_bfloat16_fused_decode_agrees_with_the_layers(bf16_engine: Engine) -> None:
    torch.manual_seed(2)
    model, spec = bf16_engine.model, bf16_engine.kv_spec
    assert spec.dtype == "bfloat16"
    filled = torch.randn(spec.flat_shape).to(torch.bfloat16)
    fused_cache, layer_cache = KVCache(spec, filled.clone()), KVCache(spec, filled.clone())
    assert DecodeLayers.build(model, fused_cache) is not None
    input_ids, positions, metadata = decode_step(bf16_engine)
    fused = model(input_ids, positions, fused_cache, metadata)
    layered = model(input_ids, positions, layer_cache, metadata, layer_hook=lambda i: None)
    assert fused.dtype == layered.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), layered.float(), atol=5e-2, rtol=5e-2)
    # layer 1's K/V come from inputs that already differ by layer 0's rounding: a few of
    # them by a few bfloat16 steps
    torch.testing.assert_close(
        fused_cache.flat.float(), layer_cache.flat.float(), atol=0.25, rtol=0.1
    )
    assert not torch.equal(fused_cache.flat, filled)


@pytest.mark.parametrize("seed", range(4))
def test_bfloat16_fused_decode_is_closer_to_exact_arithmetic(
    bf16_engine: Engine, bf16_model_dir: str, seed: int
) -> None:
    """Its float32 activations make the fused step more accurate than the layers' bfloat16
    ones: against a float32 engine on the same weights and cache, its error is smaller."""
    exact = Engine.from_model(bf16_model_dir, num_threads=1, dtype="float32").model
    torch.manual_seed(seed)
    spec = bf16_engine.kv_spec
    filled = torch.randn(spec.flat_shape).to(torch.bfloat16)
    input_ids, positions, metadata = decode_step(bf16_engine)
    step = (input_ids, positions)
    fused = bf16_engine.model(*step, KVCache(spec, filled.clone()), metadata).float()
    layered = bf16_engine.model(
        *step, KVCache(spec, filled.clone()), metadata, layer_hook=lambda i: None
    ).float()
    reference = exact(*step, KVCache(replace(spec, dtype="float32"), filled.float()), metadata)
    assert (fused - reference).norm() < (layered - reference).norm()


def test_bfloat16_fused_step_needs_no_float32_gemm(
    bf16_engine: Engine, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the float32 GEMM does not run (torch sums in an order it does not know), the
    bfloat16 step, which never calls it, is still fused; a float32 one is not."""
    monkeypatch.setattr(gemm_f32, "_kernel", lambda: None)
    decode_layers._driver.cache_clear()
    try:
        driver = decode_layers._driver()
        assert driver is not None and not driver[1].gemm
        spec = bf16_engine.kv_spec
        cache = KVCache(spec, torch.zeros(spec.flat_shape, dtype=torch.bfloat16))
        assert DecodeLayers.build(bf16_engine.model, cache) is not None
        f32 = KVCache(engine.kv_spec, torch.zeros(engine.kv_spec.flat_shape))
        assert DecodeLayers.build(engine.model, f32) is None
    finally:
        decode_layers._driver.cache_clear()  # rebuilt with the real kernel after the patch


def test_steps_the_fused_path_leaves_to_the_layers(engine: Engine) -> None:
    model = engine.model
    bf16 = KVCache.allocate(replace(engine.kv_spec, dtype="bfloat16"))
    assert DecodeLayers.build(model, bf16) is None  # not a float32 cache
    torch.manual_seed(1)
    cache = KVCache(engine.kv_spec, torch.randn(engine.kv_spec.flat_shape))
    input_ids, positions, metadata = decode_step(engine)
    bad = AttentionMetadata(
        slot_mapping=metadata.slot_mapping + engine.kv_spec.num_blocks * metadata.block_size,
        query_start_loc=metadata.query_start_loc,
        seq_lens=metadata.seq_lens,
        block_tables=metadata.block_tables,
        query_lens_list=metadata.query_lens_list,
        seq_lens_list=metadata.seq_lens_list,
        block_size=metadata.block_size,
    )
    before = cache.flat.clone()
    with pytest.raises(IndexError, match="slot out of range"):
        model(input_ids, positions, cache, bad)  # checked before the C call writes anything
    assert torch.equal(cache.flat, before)
