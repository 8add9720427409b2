"""The fused float32 decode path (every layer in one C call) equals the layer-by-layer path
bit for bit: the hidden states it returns and the K/V it writes into the cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.builtin import write_builtin_model
from engine.engine import Engine
from engine.kernels import decode_layers
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
