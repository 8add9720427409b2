"""`pdserve bench transfer`: KV transfer between two processes vs the machine's own rate.

The calling process is the decode side (receiver); a spawned process is the prefill side
(sender) whose cache holds random K/V. For each prompt length N the run measures, with
the reference and the transfer interleaved (medians of `--repeats`):

- `raw_transfer_ms`: first `send_layer` to `DONE` observed on the decode side, all layers
  issued back to back; `transfer_gb_s` = bytes / that;
- `reference_gb_s`: the same byte count moved the plain way: one memcpy between two
  preallocated buffers (shm), one device copy into the receiver's GPU (nccl, cuda_ipc), or
  one raw socket stream between the two processes (tcp);
- the overlap run: each layer is preceded by an artificial compute delay (the raw
  per-layer transfer time, so compute and transfer are equal): `overlap_total_ms` vs
  `compute_ms` + `transfer_ms`, and `handover_ms`, from the last layer computed to DONE.

Before the first measurement the sender connects and sets the connection up in full
(`Sender.warm`: on shm, the receiver's cache populated in its page tables), so the figures
are a warm connection's. The last stdout line is one JSON object (a list with several
--tokens).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch
from tqdm import tqdm

from engine.config import DTYPE_BYTES
from engine.kv_cache import KVCache, KVCacheSpec
from kvtransfer import TransferState, create_receiver, create_sender
from kvtransfer.base import Ticket

MODEL_ID = "bench"
_STAMP = struct.Struct("<d")


@dataclass(frozen=True, slots=True)
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(
            self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype
        )


def load_geometry(model_dir: str, dtype: str) -> Geometry:
    """KV geometry of a Hugging Face model directory (only config.json is read)."""
    try:
        loader = importlib.import_module("engine.loader")
    except ImportError:  # the engine's loader is optional here: read the few fields ourselves
        loader = None
    if loader is not None:
        config = loader.load_model_config(model_dir, dtype)
        return Geometry(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype
        )
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    heads = int(raw["num_attention_heads"])
    head_dim = raw.get("head_dim") or int(raw["hidden_size"]) // heads
    return Geometry(
        int(raw["num_hidden_layers"]),
        int(raw.get("num_key_value_heads") or heads),
        int(head_dim),
        dtype,
    )


# ---------------------------------------------------------------------------------------
# prefill side (spawned process)


def _prefill_worker(
    conn: Connection, backend: str, spec: KVCacheSpec, seed: int, devices: tuple[str, str]
) -> None:  # pragma: no cover - runs in the child
    torch.manual_seed(seed)
    device, receiver_device = devices  # the sender's and the receiver's
    cache = KVCache.allocate(spec, device)
    cache.flat.view(torch.uint8).random_()
    released: list[str] = []
    gpu = None if device == "cpu" else device
    sender = create_sender(backend, spec, model_id=MODEL_ID, release=released.append, device=gpu)
    ref_src = ref_dst = np.empty(0, dtype=np.uint8)
    try:
        while (msg := conn.recv()) is not None:
            op = msg[0]
            if op == "warm":  # connected, and the receiver's cache mapped in full
                sender.warm(msg[1], 120.0)
                conn.send(None)
            elif op == "transfer":
                _, ticket, src_ids, delay_s = msg
                conn.send(_send_all(sender, cache, ticket, src_ids, delay_s))
            elif op == "memcpy" and gpu:  # one device copy into the receiver's GPU
                src = torch.full((msg[1],), 7, dtype=torch.uint8, device=device)
                dst = torch.ones(msg[1], dtype=torch.uint8, device=receiver_device)
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize(receiver_device)
                conn.send(time.perf_counter() - t0)
            elif op == "memcpy":
                nbytes = msg[1]
                if ref_src.nbytes < nbytes:
                    ref_src = np.full(nbytes, 7, dtype=np.uint8)
                    ref_dst = np.full(nbytes, 1, dtype=np.uint8)  # touched: no page faults
                t0 = time.perf_counter()
                np.copyto(ref_dst[:nbytes], ref_src[:nbytes])  # one libc memcpy
                conn.send(time.perf_counter() - t0)
            elif op == "stream":
                _, port, nbytes = msg
                if ref_src.nbytes < nbytes:
                    ref_src = np.full(nbytes, 7, dtype=np.uint8)
                with socket.create_connection(("127.0.0.1", port)) as sock:
                    sock.sendall(_STAMP.pack(time.perf_counter()))
                    sock.sendall(ref_src[:nbytes].data)
                conn.send(None)
            elif op == "checksum":
                _, src_ids = msg
                conn.send(_checksums(cache, src_ids))
    finally:
        sender.close()


def _send_all(
    sender: object, cache: KVCache, ticket: Ticket, src_ids: list[int], delay_s: float
) -> tuple[float, float, str]:
    from kvtransfer import Sender

    assert isinstance(sender, Sender)
    sender.connect(ticket, 10.0)  # as PrefillServer does when the ticket arrives
    t0 = time.perf_counter()
    for layer in range(cache.num_layers):
        if delay_s:
            _compute(delay_s)
        sender.send_layer(
            ticket, layer, cache.key_caches[layer], cache.value_caches[layer], src_ids
        )
    t_last = time.perf_counter()
    sender.finish(ticket)
    state = sender.wait(ticket.request_id, 60.0)
    return t0, t_last, state.value


def _compute(seconds: float) -> None:
    """Stand-in for one layer's compute: sleep (so the CPU stays free for the copy)."""
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        time.sleep(left)


def _checksums(cache: KVCache, block_ids: list[int]) -> list[int]:
    from kvtransfer.payload import layer_crc
    from kvtransfer.rowcopy import block_rows

    return [
        layer_crc(
            block_rows(cache.key_caches[i].cpu()),
            block_rows(cache.value_caches[i].cpu()),
            block_ids,
        )
        for i in range(cache.num_layers)
    ]


# ---------------------------------------------------------------------------------------
# decode side (this process)


def _stream_reference(conn: Connection, nbytes: int, sink: np.ndarray) -> float:
    """One raw socket stream of `nbytes` from the prefill process; seconds."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        conn.send(("stream", listener.getsockname()[1], nbytes))
        sock, _ = listener.accept()
        with sock:
            stamp = bytearray(_STAMP.size)
            sock.recv_into(stamp, _STAMP.size, socket.MSG_WAITALL)
            view, got = sink[:nbytes].data, 0
            while got < nbytes:
                got += sock.recv_into(view[got:])
            elapsed = time.perf_counter() - _STAMP.unpack(stamp)[0]
    conn.recv()
    return elapsed


def _transfer(
    conn: Connection,
    receiver: object,
    rid: str,
    dst_ids: list[int],
    src_ids: list[int],
    delay_s: float,
) -> tuple[float, float, float]:
    """One transfer; returns (t_first_send, t_last_layer_computed, t_done) perf_counter s."""
    from kvtransfer import Receiver

    assert isinstance(receiver, Receiver)
    ticket = receiver.open_ticket(rid, dst_ids, deadline_s=120.0)
    conn.send(("transfer", ticket, src_ids, delay_s))
    state = receiver.wait(rid, 120.0)
    t_done = time.perf_counter()
    t0, t_last, sender_state = conn.recv()
    if state is not TransferState.DONE or sender_state != "done":
        raise RuntimeError(f"transfer {rid} ended {state} / sender {sender_state}")
    return t0, t_last, t_done


def _measure(
    args: argparse.Namespace,
    conn: Connection,
    receiver: object,
    geometry: Geometry,
    tokens: int,
    rng: np.random.Generator,
    bar: tqdm,
    sink: np.ndarray,
) -> dict[str, object]:
    from kvtransfer import Receiver

    assert isinstance(receiver, Receiver)
    n = math.ceil(tokens / args.block_size)
    dst_ids = rng.choice(receiver.spec.num_blocks, size=n, replace=False).tolist()
    if args.random_src:
        src_ids = rng.choice(n + 8, size=n, replace=False).tolist()
    else:
        start = int(rng.integers(0, 8))
        src_ids = list(range(start, start + n))
    spec = geometry.spec(n, args.block_size)
    nbytes = n * spec.bytes_per_block
    raw, ref = [], []
    for rep in range(args.repeats):
        if args.backend != "tcp":
            conn.send(("memcpy", nbytes))
            ref.append(conn.recv())
        else:
            ref.append(_stream_reference(conn, nbytes, sink))
        t0, _, t_done = _transfer(conn, receiver, f"raw-{tokens}-{rep}", dst_ids, src_ids, 0.0)
        raw.append(t_done - t0)
        bar.update(1)
    raw_s, ref_s = statistics.median(raw), statistics.median(ref)
    delay_s = raw_s / geometry.num_layers
    totals, computes, handovers = [], [], []
    for rep in range(args.repeats):
        t0, t_last, t_done = _transfer(
            conn, receiver, f"overlap-{tokens}-{rep}", dst_ids, src_ids, delay_s
        )
        totals.append(t_done - t0)
        computes.append(t_last - t0)
        handovers.append(t_done - t_last)
        bar.update(1)
    conn.send(("checksum", src_ids))
    expected = conn.recv()
    got = _checksums(receiver.kv_cache, dst_ids)
    total_s, compute_s = statistics.median(totals), statistics.median(computes)
    return {
        "backend": args.backend,
        "tokens": tokens,
        "bytes": nbytes,
        "num_layers": geometry.num_layers,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "dtype": geometry.dtype,
        "block_size": args.block_size,
        "src_blocks": "random" if args.random_src else "contiguous",
        "transfer_gb_s": round(nbytes / raw_s / 1e9, 3),
        "reference_gb_s": round(nbytes / ref_s / 1e9, 3),
        "ratio": round(ref_s / raw_s, 3),
        "raw_transfer_ms": round(raw_s * 1e3, 3),
        "reference_ms": round(ref_s * 1e3, 3),
        "handover_ms": round(statistics.median(handovers) * 1e3, 3),
        "overlap_total_ms": round(total_s * 1e3, 3),
        "compute_ms": round(compute_s * 1e3, 3),
        "transfer_ms": round(raw_s * 1e3, 3),
        "overlap_ratio": round(total_s / (compute_s + raw_s), 3),
        "verified": got == expected,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__)
    parser.add_argument("--backend", choices=("shm", "tcp", "nccl", "cuda_ipc"), default="shm")
    parser.add_argument("--device", help="nccl/cuda_ipc: the receiver's GPU (default cuda:0)")
    parser.add_argument("--sender-device", help="nccl/cuda_ipc: the sender's (default --device)")
    parser.add_argument("--model", required=True, help="model directory (config.json is read)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--random-src", action="store_true", help="random source block ids")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdserve bench transfer`; returns the process exit code."""
    args = _parse(argv)
    geometry = load_geometry(args.model, args.dtype)
    max_blocks = math.ceil(max(args.tokens) / args.block_size)
    gpu = args.backend in ("nccl", "cuda_ipc")
    device = args.device or ("cuda:0" if gpu else "cpu")
    devices = (args.sender_device or device, device)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    worker = ctx.Process(
        target=_prefill_worker,
        args=(
            child,
            args.backend,
            geometry.spec(max_blocks + 8, args.block_size),
            args.seed,
            devices,
        ),
        daemon=True,
    )
    receiver = create_receiver(
        args.backend,
        geometry.spec(max_blocks + max_blocks // 4 + 8, args.block_size),
        model_id=MODEL_ID,
        release=lambda rid: None,
        device=device if gpu else None,
    )
    worker.start()
    rng = np.random.default_rng(args.seed)
    sink = np.ones(max_blocks * geometry.spec(1, args.block_size).bytes_per_block, np.uint8)
    results: list[dict[str, object]] = []
    try:
        parent.send(("warm", receiver.endpoint))  # no measured transfer sets up a connection
        parent.recv()
        with tqdm(
            total=2 * args.repeats * len(args.tokens),
            file=sys.stderr,
            desc=f"transfer[{args.backend}]",
        ) as bar:
            for tokens in args.tokens:
                results.append(_measure(args, parent, receiver, geometry, tokens, rng, bar, sink))
    finally:
        parent.send(None)
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
        receiver.close()
    if not args.json:
        for row in results:
            assert isinstance(row["bytes"], int)
            print(
                f"{row['backend']} {row['tokens']:>6} tok {row['bytes'] / 1e6:8.1f} MB  "
                f"{row['transfer_gb_s']:6.2f} GB/s (ref {row['reference_gb_s']:.2f}, "
                f"ratio {row['ratio']:.2f})  handover {row['handover_ms']:.2f} ms  "
                f"overlap {row['overlap_total_ms']:.1f} ms vs compute {row['compute_ms']:.1f}"
                f" + transfer {row['transfer_ms']:.1f}"
            )
    print(json.dumps(results[0] if len(results) == 1 else results))
    return 0 if all(row["verified"] for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
