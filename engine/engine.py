"""The engine: scheduler + model runner + detokenizer behind a step function.

One step is three calls: `scheduler.schedule()`, `runner.execute(...)`,
`scheduler.update_from_output(...)`; then new tokens become text. Offline use goes through
`generate`; servers drive `step` from their own thread (see `engine.async_engine`).

Errors are per request. A step that raises while running the model or sampling fails no
one at once: with one request in it, that request ends with an error (finish reason
"error", blocks freed); with several, each is quarantined (`Scheduler.quarantine`: blocks
freed, output kept) and rerun alone until it passes or fails by itself, so only the culprit
gets the error and the others' output is unchanged. The exception: prefill-only requests
whose KV was streaming out in that step fail too (their blocks held until the hand-off's
release); the decode side retries them elsewhere or prefills locally. A failed step counts
none of its tokens as computed, so the K/V it may have written sits in blocks that are
freed before reuse or rewritten by the recompute. Seeded generators are untouched by a
failed step (`ModelRunner.execute`), so a seeded innocent draws the same tokens as without
the failure. Only an unusable device (a sticky CUDA error) or a bug outside a request's
step (in scheduling) escapes `step`.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from tqdm import tqdm

from engine.builtin import resolve_model_dir
from engine.config import EngineConfig
from engine.cuda_graphs import build_decode_graphs, uses_decode_graphs
from engine.detokenizer import IncrementalDetokenizer
from engine.kernels.cpu_info import cpu_info
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_cache_manager import KVCacheManager
from engine.loader import load_model, load_model_config, load_tokenizer
from engine.model import LayerHook
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel import check_shardable
from engine.prompt_graphs import PromptGraphs, token_buckets, uses_prompt_graphs
from engine.quantization import check_fp8_device, check_fp8_options
from engine.request import (
    InvalidRequestError,
    Request,
    RequestStatus,
    SamplingParams,
    check_prompt,
)
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.tp_worker import RankEndpoints, TPWorkers, WorkersLostError, start_workers

logger = logging.getLogger(__name__)


def _note_emulated_bfloat16(dtype: str, device: torch.device) -> None:
    """A warning where bfloat16 would run on an x86-64 CPU without bfloat16 products: a
    checkpoint's own dtype is often bfloat16, and there it runs emulated (`small`, batch 4,
    a Zen 4 whose hypervisor hides AVX-512: 4.8 decode tok/s against 206 in float32)."""
    info = cpu_info()
    if device.type == "cpu" and dtype == "bfloat16" and info.x86_64 and not info.bf16_products:
        logger.warning(
            "bfloat16 on a CPU without bfloat16 instructions (AVX512-BF16 or AMX) runs "
            "emulated, many times slower than float32: pass dtype='float32' to run float32"
        )


Prompt = str | list[int]
LayerHookFactory = Callable[[SchedulerOutput], LayerHook | None]


class Engine:
    """A whole single-process LLM engine over a paged KV cache. `decode_graphs` (None: on
    cuda, TP 1, not `enforce_eager`) runs decode steps through `engine.cuda_graphs`;
    `prompt_graphs` (None: `prompt_cuda_graphs` on cuda, TP 1) steps holding a prompt
    through `engine.prompt_graphs` (True on the CPU: its padded path, uncaptured)."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCache | None = None,
        decode_graphs: bool | None = None,
        prompt_graphs: bool | None = None,
        rank_endpoints: RankEndpoints | None = None,
    ) -> None:
        """`rank_endpoints` (tensor parallel only): every rank holds its own KV shard and
        each worker opens its own transfer endpoint (`kvtransfer.ranks`); `kv_cache`, when
        given, is then rank 0's shard (its endpoint's)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self._num_threads = torch.get_num_threads()  # outside spare steps (`_pick_threads`)
        self.config = config
        self.device = torch.device(config.device)
        self.model_dir = str(resolve_model_dir(config.model_dir))
        self.model_config = load_model_config(self.model_dir, config.dtype, config.quantization)
        _note_emulated_bfloat16(self.model_config.dtype, self.device)
        check_fp8_options(
            self.model_config.quantization,
            config.cache.kv_cache_dtype,
            self.model_config.dtype,
            self.device.type,
        )
        check_fp8_device(self.model_config.quantization, config.cache.kv_cache_dtype, self.device)
        check_shardable(self.model_config, config.tensor_parallel_size)
        if config.tensor_parallel_size > 1 and config.load_format != "auto":
            raise ValueError("load_format 'dummy' needs tensor_parallel_size 1")
        self.tokenizer = load_tokenizer(self.model_dir)
        self.kv_spec = KVCacheSpec.for_engine(config, self.model_config)
        per_rank = rank_endpoints is not None and config.tensor_parallel_size > 1
        if kv_cache is not None and kv_cache.spec != self.kv_spec and not per_rank:
            raise ValueError(f"given KV cache {kv_cache.spec} != engine's {self.kv_spec}")
        self.workers: TPWorkers | None = None
        if config.tensor_parallel_size > 1:  # ranks 1..N-1 in worker processes
            self.workers, self.kv_cache, rank0_cache = start_workers(
                config, self.model_dir, self.model_config, self.kv_spec, kv_cache, rank_endpoints
            )
        else:
            self.kv_cache = kv_cache or KVCache.allocate(self.kv_spec, self.device)
            rank0_cache = self.kv_cache
        tp = self.workers.tp if self.workers is not None else None
        self.model = load_model(
            self.model_config, self.model_dir, self.device, tp, config.load_format
        )
        use_graphs = uses_decode_graphs(config) if decode_graphs is None else decode_graphs
        graphs = None
        if use_graphs and tp is None:  # the scratch block stays out of the block pool
            graphs = build_decode_graphs(config, self.model, rank0_cache, self.max_model_len)
        self.kv_manager = KVCacheManager(
            self.kv_spec.num_blocks - (graphs is not None),
            self.kv_spec.block_size,
            config.cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        use_prompt = uses_prompt_graphs(config) if prompt_graphs is None else prompt_graphs
        prompts = None
        if use_prompt and tp is None:
            prompts = PromptGraphs(self.model, rank0_cache, token_buckets(config))
        self.runner = ModelRunner(
            self.model, rank0_cache, self.device, self.workers, graphs, prompts
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._held: dict[str, _Held] = {}  # requests with output_interval_s, after a token
        self._ids = itertools.count()
        # (start, seconds) of recent steps: stats, and where ITL overhead comes from
        self.step_times: deque[tuple[float, float]] = deque(maxlen=256)
        self.idle_pass = False  # the last step scheduled nothing and preempted nothing
        # Seconds of all steps, and of those on `spare_num_threads` (`_pick_threads`)
        self.step_seconds = 0.0
        self.spare_step_seconds = 0.0
        # (start, seconds, prompt tokens, all tokens) of recent steps that computed prompt
        # tokens: the replica's prefill rate, which decode-only steps (whole requests) do not
        # dilute, and the share of its time prompts take (`replica.signals.busy_share`)
        self.prompt_steps: deque[tuple[float, float, int, int]] = deque(maxlen=1024)
        self.started_at = time.perf_counter()  # the span those signals can cover

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()

    @classmethod
    def from_model(cls, model: str | None = None, **overrides: object) -> Engine:
        """An engine for a model directory (or built-in name) with default settings."""
        config = replace(EngineConfig(model_dir=model or "tiny"), **overrides)  # type: ignore[arg-type]
        return cls(config)

    # ---- requests --------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "",
        priority: int = 0,
        prefill_only: bool = False,
        output_interval_s: float = 0.0,
        spare: bool = False,
    ) -> Request:
        """Validate and build a request (raises InvalidRequestError on bad input).
        `output_interval_s`, `spare`: those fields of `Request`."""
        token_ids = self.tokenize(prompt)
        check_prompt(token_ids, params, self.model_config.vocab_size, self.max_model_len)
        total = len(token_ids) + params.max_tokens
        num_blocks = self.kv_manager.pool.num_blocks
        if self.kv_manager.num_blocks_for(total) > num_blocks:
            raise InvalidRequestError(
                f"request needs {total} tokens of KV cache, more than this replica's "
                f"{num_blocks * self.kv_spec.block_size}"
            )
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=eos,
            tenant=tenant,
            priority=priority,
            arrival_time=time.monotonic(),
            prefill_only=prefill_only,
            output_interval_s=output_interval_s,
            spare=spare,
        )

    def add_request(self, request: Request) -> None:
        """Queue a request built by `make_request` for local prefill and decode."""
        self.scheduler.add_request(request)
        self._track(request)

    def _track(self, request: Request) -> None:
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params
        )

    def reserve_for_kv(self, request: Request) -> list[int] | None:
        """Decode pool: hold blocks for a prompt prefilled elsewhere (None: no room now):
        the whole table, whose first `request.num_computed_tokens // block_size` blocks
        are this pool's cached prefix, pinned (`Scheduler.reserve_for_kv`)."""
        block_ids = self.scheduler.reserve_for_kv(request)
        if block_ids is not None:
            self._track(request)
        return block_ids

    def kv_received(
        self,
        request_id: str,
        first_token_id: int,
        logprobs: dict[int, float] | None,
        num_cached_tokens: int = 0,
    ) -> RequestOutput:
        """Decode pool: the KV landed; start decoding and return the first token's delta."""
        request = self.scheduler.kv_received(
            request_id, first_token_id, logprobs, num_cached_tokens
        )
        try:
            status = self.scheduler.check_stop(request, first_token_id)
            if status is not None:
                self.scheduler.finish_request(request_id, status)
            delta = self._emit(request, first_token_id, logprobs, request.is_finished)
            assert delta is not None  # a first token is never held
            return delta
        except Exception as exc:  # noqa: BLE001 - this request's text: fail it alone
            logger.exception("request %s failed on its first token", request_id)
            return self._fail(request, f"request failed in the engine: {exc!r}")

    def kv_failed(self, request_id: str) -> None:
        """Decode pool: the KV will not come; free the reserved blocks (no-op if gone)."""
        if self.scheduler.kv_failed(request_id, fall_back_to_local=False):
            self._forget(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request in any state and free its blocks; returns its final delta."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self._final(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def occupancy(self) -> dict[str, int]:
        """Block pool and queue sizes, consistent with each other (call it where the
        scheduler runs: this thread, between steps)."""
        scheduler = self.scheduler
        return {
            "num_blocks": self.kv_manager.pool.num_blocks,
            "num_free_blocks": self.kv_manager.num_free_blocks,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_waiting_for_kv": len(scheduler.waiting_for_kv),
            "num_held": len(scheduler.held),
            "num_suspects": len(scheduler.suspects) + (scheduler.on_trial is not None),
            "num_preemptions": scheduler.num_preemptions,
            "num_quarantined": scheduler.num_quarantined,
            # Blocks the requests holding blocks are still expected to add (kept free for
            # them, engine/growth.py; may exceed the free blocks).
            "num_kept_blocks": scheduler.growth_reserve().total,
            "queued_tokens": sum(r.num_uncomputed_tokens for r in scheduler.waiting)
            + sum(r.num_uncomputed_tokens for r in scheduler.running)
            + sum(r.num_uncomputed_tokens for r in scheduler.suspects),
        }

    # ---- the step --------------------------------------------------------------------

    def step(self, layer_hook_for: LayerHookFactory | None = None) -> list[RequestOutput]:
        """Run one scheduler step; return a delta for every request that produced news
        (a request with `output_interval_s` gets none while its tokens are held).

        `layer_hook_for(output)` may return a hook called after each layer's K/V of this
        step are in the cache (the prefill pool streams KV out from there). A request that
        fails gets a final delta with `error` set (see the module docstring); `step` raises
        only when the engine as a whole cannot go on.
        """
        start = time.perf_counter()
        self._pick_threads()
        output = self.scheduler.schedule()
        # Nothing ran and nothing moved: what waits needs an event (KV landing, an abort).
        self.idle_pass = output.is_empty and not output.preempted_ids
        num_prompt_tokens = sum(
            max(
                min(s.num_new_tokens, s.request.num_prompt_tokens - s.request.num_computed_tokens),
                0,
            )
            for s in output.scheduled
        )
        try:
            hook = layer_hook_for(output) if layer_hook_for and not output.is_empty else None
            sampled = self.runner.execute(output, hook)
        except Exception as exc:  # noqa: BLE001 - charged to the step's requests
            self._check_device()
            return self._step_failed(output, exc)
        finally:
            seconds = time.perf_counter() - start
            if not output.is_empty:  # an idle pass is no step (mean_step_ms)
                self.step_times.append((start, seconds))
                self.step_seconds += seconds
                if torch.get_num_threads() != self._num_threads:
                    self.spare_step_seconds += seconds
            if num_prompt_tokens:
                num_tokens = sum(s.num_new_tokens for s in output.scheduled)
                self.prompt_steps.append((start, seconds, num_prompt_tokens, num_tokens))
        deltas = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            sample = sampled.get(request.request_id)
            try:
                finished = self.scheduler.update_scheduled(item, sample)
                if sample is not None:
                    delta = self._emit(request, sample[0], sample[1], finished)
                    if delta is not None:
                        deltas.append(delta)
            except Exception as exc:  # noqa: BLE001 - this request's bookkeeping or text
                logger.exception("request %s failed after its step", request.request_id)
                message = f"request failed in the engine: {exc!r}"
                deltas.append(self._fail(request, message, _may_stream_kv(item)))
        return deltas

    def _pick_threads(self) -> None:
        """`spare_num_threads` for this step if every request held is `spare` (sent with
        nothing more important running, so the host's other replicas idle), else
        `num_threads`. CPU, one process (TP ranks keep theirs)."""
        spare = self.config.spare_num_threads
        if spare is None or self.workers is not None or self.device.type != "cpu":
            return
        requests = self.scheduler.requests.values()
        wide = bool(requests) and all(r.spare for r in requests)
        threads = spare if wide else self._num_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _step_failed(self, output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Charge a failed step to its requests: fail a lone one, quarantine several."""
        scheduled = [item for item in output.scheduled if not item.request.is_finished]
        if len(scheduled) == 1:
            item = scheduled[0]
            logger.warning("request %s failed its step", item.request.request_id, exc_info=exc)
            message = f"request failed in the engine: {exc!r}"
            return [self._fail(item.request, message, _may_stream_kv(item))]
        logger.warning(
            "a step of %d requests failed (%r); rerunning them one at a time", len(scheduled), exc
        )
        deltas = []
        for item in scheduled:
            if _may_stream_kv(item):
                # Its layers may be with a KV sender already: the hand-off cannot be redone
                # from other blocks, so this attempt ends (the decode side retries it).
                message = "the step streaming this request's KV failed; retry it"
                deltas.append(self._fail(item.request, message, hold=True))
            else:
                self.scheduler.quarantine(item.request)
        return deltas

    def _fail(self, request: Request, message: str, hold: bool = False) -> RequestOutput:
        """End a request with an error (its final delta carries `message`). `hold` keeps the
        blocks until `release_held` (a KV sender may still be reading them)."""
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED, hold)
        return self._final(request, error=message)

    def _check_device(self) -> None:
        """After a failed step: raise if the device itself is unusable (a sticky CUDA error
        fails every later step too, whoever is in it; so do tensor-parallel ranks that fell
        out of step, see `engine.tp_worker`); the caller must then stop the engine."""
        if self.workers is not None and (problem := self.workers.problem()) is not None:
            raise WorkersLostError(problem)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _emit(
        self,
        request: Request,
        token_id: int,
        logprobs: dict[int, float] | None,
        finished: bool,
    ) -> RequestOutput | None:
        """The delta of `request`'s new token, or None while it is held: a request with
        `output_interval_s` gets its first token at once, then its tokens merged into one
        delta per interval (and at its end). Held tokens are detokenized only when handed
        over, unless stop strings need their text at once: for a whole-answer caller that
        saves a tokenizer call per token (a third of a small model's step at batch 64)."""
        rid = request.request_id
        held = self._held.get(rid)
        if held is None:
            held = _Held()
            if request.output_interval_s > 0:
                self._held[rid] = held
        held.add(token_id, logprobs)
        now = time.monotonic()
        due = finished or now >= held.due
        if due or request.sampling_params.stop:
            held.text, finished = self._detokenize(request, held.text, held.take_undecoded())
        if not (due or finished):
            return None
        delta = self._delta(request, held.token_ids, held.text, held.logprobs)
        held.handed_over(now + request.output_interval_s)
        if finished:
            self._forget(rid)
        return delta

    def _detokenize(self, request: Request, text: str, token_ids: list[int]) -> tuple[str, bool]:
        """`text` and the text of `token_ids` after it; whether `request` is finished now (a
        stop string matched: it is finished here; a finished one gets its held-back text)."""
        detok = self._detokenizers[request.request_id]
        update = detok.update(token_ids)
        text += update.text_delta
        if update.finished and not request.is_finished:
            request.stop_reason = update.stop_str
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished and update.stop_str is None:
            text += detok.flush()
        return text, request.is_finished

    def _final(self, request: Request, error: str | None = None) -> RequestOutput:
        """The last delta of a request ended from outside a step (aborted, failed): with
        the tokens still held for it, if any, and their text (as far as the tokenizer gets:
        the request is forgotten whatever it raises)."""
        held = self._held.get(request.request_id)
        token_ids: list[int] = []
        text, logprobs = "", []
        try:
            if held is not None and held.token_ids:
                token_ids, logprobs, text = held.token_ids, held.logprobs, held.text
                text, _ = self._detokenize(request, held.text, held.take_undecoded())
        except Exception:  # noqa: BLE001 - the ending must not fail: the ids still go out
            logger.exception("request %s: text of its held tokens", request.request_id)
        finally:
            self._forget(request.request_id)
        return self._delta(request, token_ids, text, logprobs, error=error)

    def _delta(
        self,
        request: Request,
        token_ids: list[int],
        text: str,
        logprobs: list[dict[int, float]],
        error: str | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            new_logprobs=logprobs,
            finished=request.is_finished,
            finish_reason="error" if error is not None else request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_transferred_tokens=request.num_transferred_tokens,
            stop_reason=request.stop_reason,
            error=error,
        )

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._held.pop(request_id, None)
        self.runner.forget(request_id)

    # ---- offline ---------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (batched continuously); outputs in prompt order."""
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        results: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            # Only whole answers are read here: the first token, then one delta at the end.
            request = self.make_request(prompt, p, output_interval_s=math.inf)
            results[request.request_id] = CompletionOutput(
                request.request_id, list(request.prompt_token_ids)
            )
            order.append(request.request_id)
            self.add_request(request)
        bar = tqdm(total=len(order), desc="generate", disable=not progress, file=None)
        while self.has_unfinished:
            for delta in self.step():
                results[delta.request_id].add(delta)
                if delta.finished:
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]


class _Held:
    """A request's tokens since its last delta (`Engine._emit`)."""

    __slots__ = ("due", "logprobs", "text", "token_ids", "undecoded")

    def __init__(self) -> None:
        self.due = 0.0  # monotonic time the next delta may go
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.text = ""  # text of the held tokens detokenized so far
        self.undecoded: list[int] = []  # held tokens not through the detokenizer yet

    def add(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.token_ids.append(token_id)
        self.undecoded.append(token_id)
        if logprobs:
            self.logprobs.append(logprobs)

    def take_undecoded(self) -> list[int]:
        token_ids, self.undecoded = self.undecoded, []
        return token_ids

    def handed_over(self, due: float) -> None:
        self.due, self.token_ids, self.logprobs, self.text = due, [], [], ""


def _may_stream_kv(item: ScheduledRequest) -> bool:
    """Whether the prefill pool's layer hook streams `item`'s KV out during its step (the
    step completing a prefill-only prompt); such blocks stay held until `release_held`,
    however the step ends, as after a successful prefill."""
    return item.request.prefill_only and item.samples
