"""Turn a step's logits into next tokens (vLLM / OpenAI semantics).

Per row, in order (all in float32, on a copy of the logits):

1. penalties, on the raw logits: repetition (HF style: tokens seen in prompt or output have
   positive logits divided and negative logits multiplied by the penalty), then frequency
   (minus `frequency_penalty * count in output`) and presence (minus `presence_penalty` if
   the token appears in the output);
2. min_tokens: while `num_output_tokens < min_tokens`, the row's stop_token_ids and (unless
   `ignore_eos`, where eos is an ordinary token) its eos_token_ids get -inf;
3. temperature 0: argmax, done;
4. otherwise: divide by temperature, top_k, top_p (smallest set whose cumulative probability
   reaches top_p; the top token always stays), min_p (drop tokens whose probability is below
   `min_p * max probability`), then sample with an exponential race:
   `argmax(probs / E)`, `E ~ Exponential(1)` per token, which draws from `probs` exactly.

Seeded requests draw their noise from their own `torch.Generator` (see `make_generator`),
always `vocab_size` values per step in vocabulary order, so a seed gives the same tokens
whatever else is in the batch. Unseeded rows share the default generator.

Logprobs (`SamplingParams.logprobs = N`) come from the log-softmax of the raw model logits,
before penalties, temperature and filtering (OpenAI's and vLLM's default "raw" logprobs):
they describe the model, not the sampling transform. Each such row gets a dict holding the
sampled token first, then the top-N tokens in decreasing order (N + 1 entries at most).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.request import Request, SamplingParams

_MAX_SEED = 0xFFFF_FFFF_FFFF_FFFF
_NUM_CANDIDATES = 256  # top-p looks at this many largest logits before a full sort


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request; create it once and reuse it on every step.

    It must live on the device the logits are on. Any Python int is a valid seed (it is
    folded into 64 bits).
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _MAX_SEED)
    return generator


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """What the sampler needs to know about each row of one step's logits.

    Row i of the logits belongs to `params[i]`. Token id lists are referenced, not copied:
    build a batch per step, after the previous step's tokens were appended. Batch-wide flags
    (`all_greedy`, ...) are derived on construction and select the sampler's fast paths.
    """

    params: tuple[SamplingParams, ...]
    prompt_token_ids: tuple[Sequence[int], ...]
    output_token_ids: tuple[Sequence[int], ...]
    eos_token_ids: tuple[tuple[int, ...], ...]
    generators: tuple[torch.Generator | None, ...]
    all_greedy: bool = field(init=False)
    any_penalties: bool = field(init=False)
    any_min_tokens: bool = field(init=False)
    any_logprobs: bool = field(init=False)

    def __post_init__(self) -> None:
        num_rows = len(self.params)
        lengths = {
            len(self.prompt_token_ids),
            len(self.output_token_ids),
            len(self.eos_token_ids),
            len(self.generators),
        }
        assert lengths == {num_rows}, "SamplingBatch fields must have one entry per row"
        all_greedy, any_penalties, any_min_tokens, any_logprobs = True, False, False, False
        for params, output_ids in zip(self.params, self.output_token_ids, strict=True):
            all_greedy = all_greedy and params.temperature == 0.0
            any_penalties = any_penalties or params.has_penalties
            any_min_tokens = any_min_tokens or len(output_ids) < params.min_tokens
            any_logprobs = any_logprobs or params.logprobs is not None
        object.__setattr__(self, "all_greedy", all_greedy)
        object.__setattr__(self, "any_penalties", any_penalties)
        object.__setattr__(self, "any_min_tokens", any_min_tokens)
        object.__setattr__(self, "any_logprobs", any_logprobs)

    @classmethod
    def from_requests(
        cls, requests: Sequence[Request], generators: Mapping[str, torch.Generator]
    ) -> SamplingBatch:
        """One row per request, in order. `generators` maps request_id to the generator of
        each seeded request (from `make_generator`); unseeded requests need no entry.

        Raises ValueError if a seeded request has no generator.
        """
        row_generators: list[torch.Generator | None] = []
        for request in requests:
            if request.sampling_params.seed is None:
                row_generators.append(None)
                continue
            generator = generators.get(request.request_id)
            if generator is None:
                raise ValueError(
                    f"request {request.request_id!r} has a seed but no generator; "
                    "create one with make_generator(seed) and keep it for the request"
                )
            row_generators.append(generator)
        return cls(
            params=tuple(r.sampling_params for r in requests),
            prompt_token_ids=tuple(r.prompt_token_ids for r in requests),
            output_token_ids=tuple(r.output_token_ids for r in requests),
            eos_token_ids=tuple(r.eos_token_ids for r in requests),
            generators=tuple(row_generators),
        )

    def __len__(self) -> int:
        return len(self.params)


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs dict for rows that asked for them."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Stateless: `sampler(logits, batch)` with logits `[num_seqs, vocab_size]`, any float
    dtype, on any device (seeded rows' generators must be on the same device)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row; see the module docstring for the exact semantics."""
        assert logits.dim() == 2 and logits.shape[0] == len(batch), (logits.shape, len(batch))
        if batch.all_greedy and not batch.any_penalties and not batch.any_min_tokens:
            # Fast path: argmax is exact in the logits' own dtype (upcasting preserves order).
            sampled = logits.argmax(dim=-1)  # [num_seqs]
        else:
            sampled = _sample(logits.to(torch.float32, copy=True), batch)
        token_ids: list[int] = sampled.tolist()
        if batch.any_logprobs:
            logprobs = _gather_logprobs(logits, sampled, batch)
        else:
            logprobs = [None] * len(token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Full path on a float32 copy of the logits (modified in place). Returns `[num_seqs]`."""
    if batch.any_penalties:
        apply_penalties(logits, batch)
    if batch.any_min_tokens:
        apply_min_tokens(logits, batch)
    greedy_ids = logits.argmax(dim=-1)  # [num_seqs]
    if batch.all_greedy:
        return greedy_ids

    params = batch.params
    device = logits.device
    # Greedy rows are sampled too (with neutral settings) and then replaced by greedy_ids.
    temperatures = [p.temperature if p.temperature > 0.0 else 1.0 for p in params]
    if any(t != 1.0 for t in temperatures):
        logits.div_(torch.tensor(temperatures, dtype=torch.float32, device=device).unsqueeze(1))

    top_ks = [p.top_k if p.temperature > 0 else 0 for p in params]
    top_ps = [p.top_p if p.temperature > 0 else 1.0 for p in params]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        apply_top_k_top_p(logits, top_ks, top_ps)

    probs = logits.softmax(dim=-1)  # [num_seqs, vocab_size]
    min_ps = [p.min_p if p.temperature > 0 else 0.0 for p in params]
    if any(min_ps):
        min_p = _column(min_ps, device)
        probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, 0.0)

    sampled = _exponential_race(probs, batch)
    if any(p.temperature == 0.0 for p in params):
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=device)
        sampled = torch.where(greedy, greedy_ids, sampled)
    return sampled


def _exponential_race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`argmax(probs / E)` per row with E ~ Exponential(1) i.i.d. per token: an exact draw
    from each row of (unnormalized) `probs`. E = -log(U), U ~ Uniform[0, 1), so E > 0 and
    masked tokens (probability 0) never win. Seeded rows draw U from their own generator."""
    sampled_rows = [
        (row, generator)
        for row, (params, generator) in enumerate(zip(batch.params, batch.generators, strict=True))
        if params.temperature > 0.0
    ]
    noise = torch.empty_like(probs)  # [num_seqs, vocab_size]
    if any(generator is None for _, generator in sampled_rows):
        noise.uniform_()  # one batched draw; seeded rows are overwritten below
    else:
        noise.fill_(0.5)  # greedy rows' noise is never used
    for row, generator in sampled_rows:
        if generator is not None:
            noise[row].uniform_(generator=generator)
    return probs.div_(noise.log_().neg_()).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> None:
    """Set to -inf, in place, every logit outside its row's top_k (0 = off) and then outside
    its top_p nucleus (1.0 = off): the smallest prefix of the probability-sorted tokens whose
    mass reaches top_p; the top token always stays. Exact under ties (selection is by sorted
    position, not by threshold). `top_ks[i] >= vocab_size` counts as off.

    Only the `_NUM_CANDIDATES` largest logits (or max top_k, if larger) are sorted, which is
    exact whenever each row's kept set fits in them; otherwise it retries with the full sort.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    top_ks = [k if 0 < k < vocab_size else 0 for k in top_ks]
    rows = [i for i, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)) if k or p < 1.0]
    if not rows:
        return
    row_index = torch.tensor(rows, device=device)
    sub = logits if len(rows) == len(top_ks) else logits.index_select(0, row_index)
    ks = torch.tensor([top_ks[i] or vocab_size for i in rows], device=device).unsqueeze(1)
    ps_list = [top_ps[i] for i in rows]
    # 2.0, not 1.0, where top_p is off: float rounding can push the mass to 1 early.
    ps = _column([p if p < 1.0 else 2.0 for p in ps_list], device) if min(ps_list) < 1.0 else None
    max_k = max(top_ks[i] for i in rows)
    # With top_k on in every row the kept set lies within the top max_k.
    all_top_k = all(top_ks[i] for i in rows)
    num_candidates = min(vocab_size, max_k if all_top_k else max(max_k, _NUM_CANDIDATES))
    while True:
        values, ids = sub.topk(num_candidates, dim=-1)  # [rows, num_candidates], descending
        positions = torch.arange(num_candidates, device=device)
        drop = positions >= ks  # [rows, num_candidates]
        if ps is not None:
            values_k = values.masked_fill(drop, float("-inf"))
            # Normalize over the top_k set, or over the whole row where top_k is off.
            log_norm = values_k.logsumexp(dim=-1, keepdim=True)
            if not all_top_k:
                log_norm = torch.where(ks < vocab_size, log_norm, sub.logsumexp(-1, keepdim=True))
            probs = (values_k - log_norm).exp_()
            mass_before = probs.cumsum(dim=-1).sub_(probs)  # exclusive prefix sum
            drop |= mass_before >= ps
            drop[:, 0] = False
        # Both conditions only grow with position: a dropped last candidate drops the rest.
        exact = num_candidates == vocab_size or bool((drop[:, -1:] | (ks <= num_candidates)).all())
        if exact:
            break
        num_candidates = vocab_size
    filtered = torch.full_like(sub, float("-inf"))
    filtered.scatter_(1, ids, values.masked_fill_(drop, float("-inf")))
    if sub is logits:
        logits.copy_(filtered)
    else:
        logits.index_copy_(0, row_index, filtered)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition, frequency and presence penalties, in place, on rows that have any."""
    rows = [i for i, p in enumerate(batch.params) if p.has_penalties]
    if not rows:
        return
    device = logits.device
    vocab_size = logits.shape[1]
    row_index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, row_index)  # [num_rows, vocab]
    params = [batch.params[i] for i in rows]

    # Counts of each token in the output; the extra column absorbs the padding id.
    output_ids = _padded([batch.output_token_ids[i] for i in rows], vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    counts = counts[:, :vocab_size]
    in_output = counts > 0

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_ids = _padded([batch.prompt_token_ids[i] for i in rows], vocab_size, device)
        seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab_size] | in_output
        penalty = _column([p.repetition_penalty for p in params], device)
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, penalized, sub)
    if any(p.frequency_penalty != 0.0 for p in params):
        sub -= _column([p.frequency_penalty for p in params], device) * counts
    if any(p.presence_penalty != 0.0 for p in params):
        sub -= _column([p.presence_penalty for p in params], device) * in_output
    logits.index_copy_(0, row_index, sub)


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """-inf on stop tokens (and eos, unless ignore_eos) of rows still short of min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (params, output_ids, eos_ids) in enumerate(
        zip(batch.params, batch.output_token_ids, batch.eos_token_ids, strict=True)
    ):
        if len(output_ids) >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(eos_ids)
        rows.extend([row] * len(banned))
        cols.extend(banned)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _gather_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, batch: SamplingBatch
) -> list[dict[int, float] | None]:
    """Raw-logit logprobs: the sampled token first, then the top-N, per row that asked."""
    rows = [i for i, p in enumerate(batch.params) if p.logprobs is not None]
    row_index = torch.tensor(rows, device=logits.device)
    raw = logits.index_select(0, row_index).float().log_softmax(dim=-1)  # [num_rows, vocab]
    sampled_rows = sampled.index_select(0, row_index)
    sampled_lps: list[float] = raw.gather(1, sampled_rows.unsqueeze(1)).squeeze(1).tolist()
    sampled_ids: list[int] = sampled_rows.tolist()
    max_n = max(batch.params[i].logprobs or 0 for i in rows)
    top_lps: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_n > 0:
        top = raw.topk(min(max_n, raw.shape[1]), dim=-1)
        top_lps, top_ids = top.values.tolist(), top.indices.tolist()

    result: list[dict[int, float] | None] = [None] * len(batch)
    for j, row in enumerate(rows):
        num = batch.params[row].logprobs or 0
        entry = {sampled_ids[j]: sampled_lps[j]}
        for token_id, logprob in zip(top_ids[j][:num], top_lps[j][:num], strict=True):
            entry.setdefault(token_id, logprob)
        result[row] = entry
    return result


def _padded(id_lists: list[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """`[len(id_lists), max_len]` int64, right-padded with pad_id (at least one column)."""
    width = max(1, max(len(ids) for ids in id_lists))
    rows = [list(ids) + [pad_id] * (width - len(ids)) for ids in id_lists]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """`[len(values), 1]` float32 column, for per-row broadcasting."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
