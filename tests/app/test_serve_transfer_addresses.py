"""KV over tcp between replicas on different addresses, as on two hosts, in one Serve app.

The decode replica listens on 127.0.0.2 (and names that address in its tickets); the
prefill replica's connections leave from 127.0.0.3. Outputs must equal `transformers`'
greedy ones, the prefill must have run remotely, and the kernel's own table of TCP
connections (/proc/net/tcp) must show the KV connection between exactly those addresses.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.app.conftest import HFGreedy, Server

pytestmark = pytest.mark.slow

MODEL = "pdserve-tiny"
DECODE_HOST, PREFILL_HOST = "127.0.0.2", "127.0.0.3"
TCP_ESTABLISHED = "01"


def pdserve_args(model_dir: Path) -> dict[str, Any]:
    return {
        "model": {"model": str(model_dir), "num_threads": 1, "kv_cache_bytes": 32 * 1024**2},
        "pools": [
            {"name": "prefill", "role": "prefill", "num_cpus": 0.5},
            {"name": "decode", "role": "decode", "num_cpus": 0.5},
        ],
        "transfer": {
            "backend": "tcp",
            "bind_host": DECODE_HOST,
            "source_host": PREFILL_HOST,
            "deadline_s": 20.0,
        },
        "local_prefill_threshold": 0,
    }


def _address(hex_address: str) -> tuple[str, int]:
    """`0200007F:1F90` (as /proc/net/tcp writes IPv4) -> `("127.0.0.2", 8080)`."""
    host, port = hex_address.split(":")
    octets = bytes.fromhex(host)[::-1]  # little-endian on the machines we run on
    return ".".join(str(b) for b in octets), int(port, 16)


def established_tcp() -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """(local, remote) address pairs of every established IPv4 TCP connection here."""
    with open("/proc/net/tcp", encoding="ascii") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return [(_address(r[1]), _address(r[2])) for r in rows if r[3] == TCP_ESTABLISHED]


def kv_links() -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """The established connections from the prefill replica's address to the decode one's."""
    return [
        (local, remote)
        for local, remote in established_tcp()
        if local[0] == PREFILL_HOST and remote[0] == DECODE_HOST
    ]


def test_the_prefill_replica_connects_before_the_first_request(server: Server) -> None:
    """The decode replica has the prefill replica connect to it when it starts (the first
    remote prefill then meets a ready connection), before any request: runs first here."""
    deadline = time.monotonic() + 60.0
    while not kv_links():
        assert time.monotonic() < deadline, f"no KV connection yet: {established_tcp()}"
        time.sleep(0.2)
    decode = server.stats()["pools"]["decode"]
    assert decode["kv_endpoint"]["connections"] == 1
    assert decode["counters"].get("remote_prefill", 0) == 0


def test_decode_and_prefill_on_different_addresses_exchange_kv_over_tcp(
    server: Server, hf: HFGreedy
) -> None:
    prompts = ["the first prompt crosses hosts", "and so does a second, longer prompt " * 3]
    client = server.openai()
    for prompt in prompts:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == hf.complete(prompt, 12).text
    counters = server.stats()["pools"]["decode"]["counters"]
    assert counters.get("remote_prefill", 0) == len(prompts)
    # The prefill replica keeps its connection to the decode replica's endpoint open.
    assert len(kv_links()) == 1, established_tcp()
