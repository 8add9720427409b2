"""Prefill-side helpers that run in spawned processes for the kvtransfer tests.

A `SendJob` describes what the prefill process does with one or more tickets; `serve`
runs jobs sent over a pipe (one long-lived process for many tests), `send_then_hang`
sends some layers and then stalls so a test can kill it. Spawned children inherit the
parent's sys.path, so this module and the repo import as in the test process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import KVTransferError, TransferOptions, create_sender
from kvtransfer.base import Ticket


def source_cache(spec: KVCacheSpec, seed: int) -> KVCache:
    """Deterministic random K/V (the same in every process for the same spec and seed)."""
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(spec.flat_shape, generator=generator).to(spec.torch_dtype)
    return KVCache(spec, flat)


@dataclass(frozen=True)
class SendJob:
    backend: str
    spec: KVCacheSpec
    tickets: tuple[tuple[Ticket, tuple[int, ...]], ...]  # (ticket, source block ids)
    seed: int = 0
    model_id: str = "test-model"
    options: TransferOptions = field(default_factory=TransferOptions)
    layer_delay_s: float = 0.0  # simulated compute before each layer
    abort_after_layer: int | None = None  # sender aborts every ticket after it (-1: first)
    hang_after_layer: int | None = None  # send_then_hang: stall after this layer
    finish: bool = True
    connect_first: bool = False  # call sender.connect(ticket) first and report its error
    wait_s: float = 10.0
    device: str = "cpu"  # where the source cache lives (nccl: a CUDA device)


def run_job(job: SendJob) -> dict[str, object]:
    """Do the job; report per-ticket final states, errors, releases and timestamps."""
    released: list[str] = []
    cache = source_cache(job.spec, job.seed)
    extra: dict[str, object] = {}
    if job.device != "cpu":
        cache = KVCache(job.spec, cache.flat.to(job.device))
        extra["device"] = job.device
    sender = create_sender(
        job.backend,
        job.spec,
        model_id=job.model_id,
        release=released.append,
        options=job.options,
        **extra,
    )
    result: dict[str, object] = {"pid": os.getpid()}
    try:
        if job.connect_first:
            try:
                sender.connect(job.tickets[0][0], 5.0)
                result["connect_error"] = None
            except KVTransferError as exc:
                result["connect_error"] = (type(exc).__name__, str(exc))
        if job.abort_after_layer == -1:  # before any layer (after connect, if asked)
            for ticket, _ in job.tickets:
                sender.abort(ticket.request_id)
        result["t_first_send"] = time.perf_counter()
        for layer in range(job.spec.num_layers):
            if job.layer_delay_s:
                time.sleep(job.layer_delay_s)
            for ticket, src_ids in job.tickets:
                k, v = cache.key_caches[layer], cache.value_caches[layer]
                sender.send_layer(ticket, layer, k, v, list(src_ids))
            if job.abort_after_layer == layer:
                for ticket, _ in job.tickets:
                    sender.abort(ticket.request_id)
        result["t_last_computed"] = time.perf_counter()
        if job.finish:
            for ticket, _ in job.tickets:
                sender.finish(ticket)
        states, errors = {}, {}
        for ticket, _ in job.tickets:
            rid = ticket.request_id
            states[rid] = sender.wait(rid, job.wait_s).value
            error = sender.error(rid)
            errors[rid] = None if error is None else (type(error).__name__, str(error))
        deadline = time.monotonic() + job.wait_s
        while len(released) < len(job.tickets) and time.monotonic() < deadline:
            time.sleep(0.005)
        result.update(states=states, errors=errors)
    finally:
        sender.close()
    result["released"] = list(released)
    return result


def serve(conn: Connection) -> None:
    """Run jobs from `conn` until None arrives."""
    while (job := conn.recv()) is not None:
        try:
            conn.send(run_job(job))
        except Exception as exc:  # report, keep serving
            conn.send({"exception": repr(exc)})


def send_then_hang(job: SendJob, conn: Connection) -> None:
    """Send layers up to `hang_after_layer`, say so, then stall until killed."""
    cache = source_cache(job.spec, job.seed)
    sender = create_sender(
        job.backend, job.spec, model_id=job.model_id, release=lambda rid: None, options=job.options
    )
    assert job.hang_after_layer is not None
    for layer in range(job.hang_after_layer + 1):
        for ticket, src_ids in job.tickets:
            k, v = cache.key_caches[layer], cache.value_caches[layer]
            sender.send_layer(ticket, layer, k, v, list(src_ids))
    conn.send("hanging")
    time.sleep(600)


def receive_then_wait(
    backend: str, spec: KVCacheSpec, block_ids: tuple[int, ...], conn: Connection
) -> None:
    """Decode side in a child: open one ticket, hand it over, then idle until killed."""
    from kvtransfer import create_receiver

    receiver = create_receiver(backend, spec, model_id="test-model", release=lambda rid: None)
    conn.send(receiver.open_ticket("victim", block_ids, 60.0))
    time.sleep(600)
