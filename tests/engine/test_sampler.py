"""Sampler: greedy, seeded reproducibility, filters, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)

VOCAB = 64
SAMPLER = Sampler()


def _request(
    params: SamplingParams,
    request_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: tuple[int, ...] = (),
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt if prompt is not None else [1, 2, 3],
        sampling_params=params,
        eos_token_ids=eos,
        output_token_ids=output if output is not None else [],
    )


def _batch(
    *requests: Request, generators: dict[str, torch.Generator] | None = None
) -> SamplingBatch:
    return SamplingBatch.from_requests(requests, generators or {})


def _sample_rows(params: list[SamplingParams], logits: torch.Tensor) -> list[int]:
    batch = _batch(*(_request(p, f"r{i}") for i, p in enumerate(params)))
    return SAMPLER(logits, batch).token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(16, VOCAB).to(dtype)
    out = _sample_rows([SamplingParams(temperature=0.0)] * 16, logits)
    assert out == logits.float().argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = torch.randn(6, VOCAB)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.5)] * 3
    out = _sample_rows(params, logits)
    assert out[0::2] == logits[0::2].argmax(dim=-1).tolist()


def _seeded_tokens(position: int, other_params: list[SamplingParams], seed: int) -> list[int]:
    """Ten steps of one seeded request placed at `position` among other requests."""
    torch.manual_seed(1000 + position)  # other rows draw from the default generator
    target = _request(SamplingParams(temperature=0.9, seed=seed), "target")
    others = [_request(p, f"o{i}") for i, p in enumerate(other_params)]
    generators = {"target": make_generator(seed)}
    generators.update({r.request_id: make_generator(i) for i, r in enumerate(others)})
    step_logits = torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(7))
    tokens = []
    for step in range(10):
        requests = others[:position] + [target] + others[position:]
        logits = torch.randn(len(requests), VOCAB)
        logits[position] = step_logits[step]
        batch = SamplingBatch.from_requests(requests, generators)
        tokens.append(SAMPLER(logits, batch).token_ids[position])
    return tokens


def test_seed_reproducible_regardless_of_batch() -> None:
    alone = _seeded_tokens(0, [], seed=42)
    mixes = [
        [SamplingParams(temperature=1.0)] * 3,
        [SamplingParams(temperature=0.0), SamplingParams(top_p=0.3, top_k=5)],
        [SamplingParams(repetition_penalty=1.3, min_p=0.1), SamplingParams(seed=42)] * 2,
    ]
    for others in mixes:
        for position in range(len(others) + 1):
            assert _seeded_tokens(position, others, seed=42) == alone
    assert _seeded_tokens(0, [], seed=43) != alone


def test_from_requests_requires_a_generator_for_seeded_requests() -> None:
    with pytest.raises(ValueError, match="make_generator"):
        _batch(_request(SamplingParams(seed=1)))


def test_make_generator_accepts_any_int() -> None:
    for seed in (0, -1, 2**70):
        make_generator(seed)
    a = torch.rand(4, generator=make_generator(5))
    assert torch.equal(a, torch.rand(4, generator=make_generator(5)))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(32, VOCAB)
    expected = logits.argmax(dim=-1).tolist()
    for params in (
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=2.0, min_p=1.0),
    ):
        assert _sample_rows([params] * 32, logits) == expected


def _log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def _support(params: SamplingParams, logits_row: torch.Tensor, num: int = 400) -> set[int]:
    logits = logits_row.expand(num, -1).clone()
    return set(_sample_rows([params] * num, logits))


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    row = _log_probs([0.05, 0.5, 0.15, 0.3])
    assert _support(SamplingParams(top_p=0.75), row) == {1, 3}
    assert _support(SamplingParams(top_p=0.85), row) == {1, 2, 3}
    assert _support(SamplingParams(top_p=0.4), row) == {1}


def test_top_k_keeps_k_largest() -> None:
    row = _log_probs([0.05, 0.5, 0.15, 0.3])
    assert _support(SamplingParams(top_k=2), row) == {1, 3}
    assert _support(SamplingParams(top_k=3, top_p=0.7), row) == {1, 3}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    row = _log_probs([0.05, 0.5, 0.15, 0.3])
    assert _support(SamplingParams(min_p=0.5), row) == {1, 3}  # threshold 0.25
    assert _support(SamplingParams(min_p=0.2), row) == {1, 2, 3}  # threshold 0.1


def test_top_k_top_p_match_a_reference_on_large_vocab() -> None:
    """Covers the candidate shortcut and its fall back to a full sort."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen) * torch.tensor([0.1, 5.0] * 4).unsqueeze(1)
    top_ks = [0, 0, 10, 0, 300, 999, 0, 5]
    top_ps = [0.9, 0.5, 1.0, 1.0, 0.99, 0.3, 0.999, 0.8]
    actual = logits.clone()
    apply_top_k_top_p(actual, top_ks, top_ps)
    for row, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)):
        order = logits[row].argsort(descending=True).tolist()
        kept = order[:k] if k else order
        probs = logits[row, kept].softmax(dim=-1).tolist()
        mass = 0.0
        expected: list[int] = []
        for token, prob in zip(kept, probs, strict=True):
            if expected and mass >= p and p < 1.0:
                break
            expected.append(token)
            mass += prob
        assert set(torch.isfinite(actual[row]).nonzero().flatten().tolist()) == set(expected)
        assert torch.equal(actual[row, expected], logits[row, expected])


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    batch = _batch(_request(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1]))
    apply_penalties(logits, batch)
    assert logits.tolist() == [[1.0, -2.0, 0.5, 3.0, -4.0]]


def test_frequency_and_presence_penalties_exact() -> None:
    base = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]] * 3)
    params = [
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(),  # untouched in a batch with penalties
    ]
    requests = [_request(p, f"r{i}", prompt=[3], output=[2, 2, 1]) for i, p in enumerate(params)]
    logits = base.clone()
    apply_penalties(logits, _batch(*requests))
    assert logits[0].tolist() == [2.0, -1.5, -0.5, 3.0, -4.0]  # prompt token 3 unaffected
    assert logits[1].tolist() == [2.0, 0.5, 2.0, 3.0, -4.0]
    assert torch.equal(logits[2], base[2])


def test_penalties_apply_to_greedy_sampling() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = SAMPLER(logits, _batch(_request(greedy, prompt=[0]))).token_ids
    assert out == [1]


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=(5,))
    ignore = SamplingParams(min_tokens=3, stop_token_ids=(5,), ignore_eos=True)
    requests = [
        _request(params, "short", output=[1, 1], eos=(7, 8)),
        _request(params, "done", output=[1, 1, 1], eos=(7, 8)),
        _request(ignore, "ignore", output=[1], eos=(7, 8)),
    ]
    logits = torch.zeros(3, 10)
    apply_min_tokens(logits, _batch(*requests))
    masked = [set(torch.isinf(row).nonzero().flatten().tolist()) for row in logits]
    assert masked == [{5, 7, 8}, set(), {5}]


def test_min_tokens_prevents_sampling_eos() -> None:
    logits = torch.tensor([[0.0, 10.0, 0.0]] * 2)  # eos (1) is by far the likeliest
    requests = [
        _request(SamplingParams(temperature=0.0, min_tokens=1), "g", eos=(1,)),
        _request(SamplingParams(min_tokens=1), "s", eos=(1,)),
    ]
    for _ in range(20):
        assert 1 not in SAMPLER(logits, _batch(*requests)).token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_with_top_n(temperature: float, dtype: torch.dtype) -> None:
    logits = torch.randn(3, VOCAB).to(dtype)
    params = [
        SamplingParams(temperature=temperature, logprobs=5, repetition_penalty=1.5, top_k=3),
        SamplingParams(temperature=temperature),
        SamplingParams(temperature=temperature, logprobs=0),
    ]
    requests = [_request(p, f"r{i}", output=[0, 1]) for i, p in enumerate(params)]
    out = SAMPLER(logits, _batch(*requests))
    expected = logits.float().log_softmax(dim=-1)  # raw: before penalties and temperature
    assert out.logprobs[1] is None
    assert out.logprobs[2] is not None and list(out.logprobs[2]) == [out.token_ids[2]]
    entry = out.logprobs[0]
    assert entry is not None and next(iter(entry)) == out.token_ids[0]
    top5 = expected[0].topk(5).indices.tolist()
    # After the sampled token: the N largest, in decreasing order.
    assert list(entry)[1:] == [t for t in top5 if t != out.token_ids[0]]
    for token_id, logprob in entry.items():
        assert logprob == pytest.approx(expected[0, token_id].item(), abs=1e-5)


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_distribution_matches_softmax(temperature: float) -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    target = [p ** (1 / temperature) for p in probs]
    target = [t / sum(target) for t in target]
    num = 20_000
    logits = _log_probs(probs).expand(num, -1).clone()
    tokens = _sample_rows([SamplingParams(temperature=temperature)] * num, logits)
    counts = [tokens.count(i) for i in range(4)]
    assert _chi_square(counts, target) < 30.0  # 3 dof: p ~ 1e-6


def test_seeded_stream_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = _log_probs(probs).unsqueeze(0)
    generators = {"r": make_generator(123)}
    batch = _batch(_request(SamplingParams(seed=123)), generators=generators)
    tokens = [SAMPLER(logits, batch).token_ids[0] for _ in range(3000)]
    counts = [tokens.count(i) for i in range(4)]
    assert _chi_square(counts, probs) < 30.0
    assert not math.isnan(_chi_square(counts, probs))
