"""Where a request's history is cached, for decode overflow (`app/routing/overflow.py`).

Each chat turn sends the whole history again, and the side that served the previous turn
caches it: the decode replica (which then prefills only the new suffix itself, or receives
only the blocks it lacks) or, after a turn served whole, the prefill replica. So before its
load rule, decode overflow looks up how much of the prompt each pool caches for the tenant,
in the prefix indexes this process's replica routers keep (`prefix_index.shared`, fed by the
replicas' digests and the routers' own sends), and:

- a serving prefill pool caching more of it than the decode pool takes the request whole
  while its decode load is within the prefix margin of the decode pool's
  (`prefix_choice.within_margin`: 4 sequences, or half the smaller load);
- a decode pool caching more keeps the route while its load is within that margin of the
  least loaded candidate's;
- when what the other side lacks is shorter than `local_prefill_threshold` (cheap enough
  to compute anywhere: a short prompt, or a turn both sides hold but for the last answer),
  or the holder is past the margin, the load rule decides, so neither a repeated short
  prompt nor one hot conversation can pin a replica.

With the load rule alone, 22 of 96 later turns moved away from their history (BENCHMARKS.md,
multi-turn). A route also says where its prompt will compute and how much of it
(`RouteDecision.computes`, `prompt_computes`): the ingress counts those tokens as computing
there, and decode overflow keeps whole requests off a pool with many prompt tokens computing,
so counting a turn's whole prompt on the prefill pool when the decode replica computes its
64-token suffix itself would read the prefill replica as busy with prompts it never sees.
Event loop only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.routing import prefix_index
from app.routing.prefix_choice import within_margin
from replica.prefix_digest import prompt_block_keys


@dataclass(frozen=True, slots=True)
class History:
    """What each side caches of one prompt: `cached` tokens per candidate pool,
    `decode_cached` on the decode pool, of `num_prompt_tokens`; `min_tokens`: the shortest
    part the other side must lack for the holder to be followed (`local_prefill_threshold`)."""

    cached: Mapping[str, int]
    decode_cached: int
    num_prompt_tokens: int
    min_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Held:
    """Where the route goes for its history: `pool` (None: the route stands) and why."""

    pool: str | None
    reason: str


def cached_tokens(
    pools: Sequence[str], prompt_token_ids: Sequence[int], tenant: str
) -> dict[str, int]:
    """Tokens of the prompt's longest prefix cached on each pool's replicas for `tenant`, as
    this process's replica routers know them (0 where none does), at most the prompt's
    full blocks before its last token, as the engine reuses them (one token is always
    computed: the next token's logits come from it)."""
    cached = dict.fromkeys(pools, 0)
    keys: dict[int, list[int]] = {}  # block size -> the prompt's block keys
    for pool in cached:  # each pool once
        index = prefix_index.shared.get(pool)
        size = index.block_size if index is not None else None
        if index is None or not size or len(prompt_token_ids) < size:
            continue
        if size not in keys:
            keys[size] = prompt_block_keys(
                prompt_token_ids, size, tenant, prefix_index.MAX_PROMPT_BLOCKS
            )
        usable = (len(prompt_token_ids) - 1) // size
        cached[pool] = min(index.longest(keys[size]), usable) * size
    return cached


def follow_prefix(decode: float, idle: Mapping[str, float], history: History) -> Held | None:
    """The side holding more of the prompt, given the decode load of the decode pool's least
    loaded replica (`decode`) and of each candidate pool's (`idle`), while its load is within
    the prefix margin of the other's and the other lacks at least `history.min_tokens` of the
    prompt; None otherwise (the load rule decides)."""
    cached, decode_cached = history.cached, history.decode_cached
    pool = max(idle, key=lambda p: cached.get(p, 0))
    held = cached.get(pool, 0)
    figures = f"{held} on {pool} vs {decode_cached} on decode"
    loads = f"decode load {idle[pool]:.1f} on {pool} vs {decode:.1f} on decode"

    def worth(more: int, less: int) -> bool:
        return more > less and history.num_prompt_tokens - less >= history.min_tokens

    if worth(held, decode_cached) and within_margin(idle[pool], decode):
        return Held(pool, f"prefix cached: {figures} tokens, {loads} -> served whole on {pool}")
    if worth(decode_cached, held) and within_margin(decode, min(idle.values())):
        return Held(None, f"prefix cached: {figures} tokens, {loads}: route stands")
    return None


def prompt_computes(
    decode_pool: str,
    prefill_pool: str | None,
    num_prompt_tokens: int,
    cached: Mapping[str, int],
    local_prefill_threshold: int,
) -> tuple[str, int]:
    """Where a standing route's prompt computes, and how many tokens: on the decode pool
    what its cache lacks when that is local (no prefill pool, or a suffix shorter than
    `local_prefill_threshold`, which the decode replica computes itself: `decode/server.py`),
    else on the prefill pool what its cache lacks."""
    decode_cached = cached.get(decode_pool, 0)
    suffix = num_prompt_tokens - decode_cached
    short = decode_cached > 0 and suffix < local_prefill_threshold
    if prefill_pool is None or short:
        return decode_pool, suffix
    return prefill_pool, num_prompt_tokens - cached.get(prefill_pool, 0)
