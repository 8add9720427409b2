"""Fixtures of the end-to-end Serve tests (`test_serve_*.py`): a real Ray Serve app over HTTP.

A test module that uses the `server` fixture defines `pdserve_args(model_dir) -> dict`, the
application args (a `PDServeConfig` document). Its app is deployed when the module starts and
deleted when it ends. The local Ray instance under it (2 CPUs, Serve on a free HTTP port) is
kept for the next module only if that one deploys on `server` too: it is shut down before
any other module runs (one that starts Ray itself, or none), and after a module whose app
could not be deleted cleanly. Every test of such a module is followed by a check that every
pool's KV blocks are free again.

Reference outputs come from `transformers` on the same checkpoint (greedy, float32).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from bench.serve.deploy import start_serve
from engine.builtin import write_builtin_model

SERVED_MODEL = "pdserve-tiny"  # "pdserve-" + the model directory's name
POOLS_IDLE_TIMEOUT_S = 30.0  # bounds a failing run only: a test that needs less says so
POOL_RESTART_TIMEOUT_S = 120.0  # a pool whose replica was killed answers stats again by then
STARTUP_TIMEOUT_S = 180.0


@dataclass(frozen=True, slots=True)
class Reference:
    """`transformers`' greedy generation for one prompt."""

    prompt_ids: list[int]
    output_ids: list[int]  # new tokens, EOS included when generation stopped on it
    text: str  # the new tokens decoded with skip_special_tokens=True
    logprobs: list[float]  # log-softmax of the chosen token at each step


class HFGreedy:
    """Greedy generation with `transformers` (the ground truth the server must match)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple[tuple[int, ...], int], Reference] = {}

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        return list(ids)

    def complete(self, prompt: str, max_tokens: int) -> Reference:
        return self.generate(self.prompt_ids(prompt), max_tokens)

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Reference:
        return self.generate(self.chat_ids(messages), max_tokens)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Reference:
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._cache:
            self._cache[key] = self._generate(prompt_ids, max_tokens)
        return self._cache[key]

    @torch.inference_mode()
    def _generate(self, prompt_ids: list[int], max_tokens: int) -> Reference:
        input_ids = torch.tensor([prompt_ids])
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        output_ids = out.sequences[0, len(prompt_ids) :].tolist()
        logprobs = [
            torch.log_softmax(step[0].float(), dim=-1)[token].item()
            for step, token in zip(out.logits, output_ids, strict=True)
        ]
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        return Reference(prompt_ids, output_ids, text, logprobs)


@dataclass(frozen=True, slots=True)
class Server:
    """A running pdserve application and clients for it."""

    base_url: str
    http: httpx.Client
    args: dict[str, Any]

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        """The official client; no retries, so every status code is seen as sent."""
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120
        )

    def stats(self) -> dict[str, Any]:
        admin_keys = self.args.get("admin_api_keys") or ["none"]
        response = self.http.get(
            "/v1/pdserve/stats", headers={"Authorization": f"Bearer {admin_keys[0]}"}
        )
        assert response.status_code == 200, response.text
        return response.json()

    def busy_pools(self) -> dict[str, tuple[int, int] | None]:
        """Pools whose KV blocks are not all free: name -> (num_free_blocks, num_blocks), or
        None for a pool that does not answer (no live replica: one was just killed)."""
        return {
            name: None if "error" in pool else (pool["num_free_blocks"], pool["num_blocks"])
            for name, pool in self.stats()["pools"].items()
            if "error" in pool or pool["num_free_blocks"] != pool["num_blocks"]
        }

    def wait_pools_idle(self, timeout_s: float = POOLS_IDLE_TIMEOUT_S) -> None:
        """Poll until every pool's KV blocks are free (freeing is asynchronous). A pool that
        does not answer is waited for up to `POOL_RESTART_TIMEOUT_S`; `timeout_s` for the
        blocks counts from when every pool answers."""
        restart_deadline = time.monotonic() + POOL_RESTART_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        while busy := self.busy_pools():
            now = time.monotonic()
            if None in busy.values():
                if now > restart_deadline:
                    pytest.fail(f"pools not answering {POOL_RESTART_TIMEOUT_S}s after the test")
                deadline = now + timeout_s
            elif now > deadline:
                pytest.fail(f"KV blocks still in use {timeout_s}s after the test: {busy}")
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` every 0.1 s; fail the test if it is not true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, written fresh (its directory name makes it `pdserve-tiny`)."""
    return write_builtin_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def hf(model_dir: Path) -> HFGreedy:
    return HFGreedy(model_dir)


_ray: dict[str, int] = {}  # {"port": Serve's HTTP port} while this module holds Ray


def _serve_port() -> int:
    """The HTTP port of the Serve instance the `server` modules share; started if need be."""
    import ray

    if "port" not in _ray:
        # address="local": never attach to a cluster someone else started on this machine.
        # Replica logs stay in the Ray session dir (not the test output); failures show there.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            _ray["port"] = start_serve()
        except BaseException:
            ray.shutdown()
            raise
    return _ray["port"]


def _stop_ray() -> None:
    import ray
    from ray import serve

    if _ray.pop("port", None) is None:
        return
    with contextlib.suppress(Exception):
        serve.shutdown()
    ray.shutdown()


def _deploys_on_server(item: pytest.Item | None) -> bool:
    """Whether `item`'s module deploys its app with this file's `server` fixture."""
    if item is None or not hasattr(getattr(item, "module", None), "pdserve_args"):
        return False
    defs = item.session._fixturemanager.getfixturedefs("server", item) or ()
    return bool(defs) and defs[-1].func.__module__ == __name__


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the module fixtures' teardown: Ray goes unless the next module deploys on it."""
    try:
        return (yield)
    finally:
        if not _deploys_on_server(nextitem):
            _stop_ray()


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Server]:
    """The module's `pdserve_args(model_dir)` app, on the shared local Ray instance."""
    from ray import serve

    from app.main import build_app

    args: dict[str, Any] = request.module.pdserve_args(model_dir)
    port = _serve_port()
    try:
        serve.run(build_app(args), name="pdserve", route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base_url, timeout=120) as http:
            wait_until(lambda: _is_healthy(http), STARTUP_TIMEOUT_S, "GET /health to answer 200")
            yield Server(base_url=base_url, http=http, args=args)
    finally:
        try:  # every app the module ran (some run another beside pdserve); each is drained
            for name in serve.status().applications:
                serve.delete(name)
        except Exception:  # noqa: BLE001 - the next module then starts on a fresh instance
            _stop_ray()


def _is_healthy(http: httpx.Client) -> bool:
    try:
        return http.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(autouse=True)
def _pools_idle_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each end-to-end test, every pool's KV blocks must be free again (no leaks)."""
    if "server" not in request.fixturenames:
        yield
        return
    server: Server = request.getfixturevalue("server")
    yield
    server.wait_pools_idle()
