"""`pdserve batch ...`: submit a JSONL file as a batch job and collect its results.

    pdserve batch submit in.jsonl --url http://127.0.0.1:8000 --wait --out out.jsonl
    pdserve batch status batch_...   |   pdserve batch cancel batch_...

The official `openai` client talks to the service (any OpenAI-compatible Batch API). With
`--wait` a progress bar (stderr) follows the job; at the end come its throughput and cost
(the batch's `pdserve_*` metadata) and the output lines are written to `--out`. stdout gets
the batch id, or the final batch object with `--json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TERMINAL = ("completed", "failed", "expired", "cancelled")
BAR_WIDTH = 30


def _service_arguments(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """`--url` and `--api-key`, on the command (with their defaults) and on each action
    (without: given after the action, as in `pdserve batch submit in.jsonl --url ...`, they
    replace the command's; left out there, the command's stay)."""
    url, key = "http://127.0.0.1:8000", os.environ.get("OPENAI_API_KEY", "none")
    parser.add_argument(
        "--url", default=url if defaults else argparse.SUPPRESS, help="the service's base URL"
    )
    parser.add_argument(
        "--api-key",
        default=key if defaults else argparse.SUPPRESS,
        help="the tenant's key (default: $OPENAI_API_KEY)",
    )


def build_parser(prog: str = "pdserve batch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    _service_arguments(parser, defaults=True)
    service = argparse.ArgumentParser(add_help=False)
    _service_arguments(service, defaults=False)
    sub = parser.add_subparsers(dest="action", required=True)
    submit = sub.add_parser(
        "submit", parents=[service], help="upload a JSONL file and create a batch over it"
    )
    submit.add_argument("input", type=Path, help="one request per line (OpenAI batch format)")
    submit.add_argument(
        "--endpoint",
        default=None,
        choices=["/v1/completions", "/v1/chat/completions"],
        help="default: the first line's url",
    )
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends")
    submit.add_argument("--out", type=Path, help="with --wait: write the output lines here")
    submit.add_argument("--errors", type=Path, help="with --wait: write the error lines here")
    submit.add_argument("--poll-s", type=float, default=1.0, help="seconds between polls")
    submit.add_argument("--json", action="store_true", help="print the final batch object")
    for name, help_text in (("status", "show a batch"), ("cancel", "cancel a batch")):
        action = sub.add_parser(name, parents=[service], help=help_text)
        action.add_argument("batch_id")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "pdserve batch") -> int:
    import openai

    args = build_parser(prog).parse_args(argv)
    for name in ("httpx", "httpx2", "openai"):  # no log line per poll
        logging.getLogger(name).setLevel(logging.WARNING)
    client = openai.OpenAI(base_url=f"{args.url.rstrip('/')}/v1", api_key=args.api_key)
    try:
        if args.action == "status":
            print(client.batches.retrieve(args.batch_id).model_dump_json(indent=2))
            return 0
        if args.action == "cancel":
            print(client.batches.cancel(args.batch_id).model_dump_json(indent=2))
            return 0
        return submit(client, args)
    except openai.APIStatusError as exc:
        print(f"pdserve batch: error {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    except (OSError, ValueError, openai.APIConnectionError) as exc:
        print(f"pdserve batch: error: {exc}", file=sys.stderr)
        return 2


def submit(client: Any, args: argparse.Namespace) -> int:
    content = args.input.read_bytes()
    endpoint = args.endpoint or _first_url(content)
    file = client.files.create(file=(args.input.name, content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")
    print(f"batch {batch.id} ({file.id}, {endpoint})", file=sys.stderr)
    if not args.wait:
        print(batch.id)
        return 0
    started = time.monotonic()
    while batch.status not in TERMINAL:
        time.sleep(args.poll_s)
        batch = client.batches.retrieve(batch.id)
        _progress(batch, time.monotonic() - started)
    print(file=sys.stderr)
    for path, file_id in ((args.out, batch.output_file_id), (args.errors, batch.error_file_id)):
        if path is not None and file_id is not None:
            path.write_bytes(client.files.content(file_id).content)
    print(summary(batch.model_dump(), time.monotonic() - started), file=sys.stderr)
    print(batch.model_dump_json(indent=2) if args.json else batch.id)
    return 0 if batch.status == "completed" else 1


def _first_url(content: bytes) -> str:
    for raw in content.splitlines():
        if raw.strip():
            url = json.loads(raw).get("url")
            if url in ("/v1/completions", "/v1/chat/completions"):
                return str(url)
            raise ValueError(f"the first line's url {url!r} is not a batch endpoint")
    raise ValueError("the input file is empty")


def _progress(batch: Any, elapsed_s: float) -> None:
    counts = batch.request_counts
    done = (counts.completed + counts.failed) if counts else 0
    total = counts.total if counts else 0
    filled = BAR_WIDTH * done // total if total else 0
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    failed = f", {counts.failed} failed" if counts and counts.failed else ""
    line = f"\r[{bar}] {done}/{total} lines{failed}  {batch.status}  {elapsed_s:.0f} s"
    print(line, end="", file=sys.stderr, flush=True)


def summary(batch: dict[str, Any], elapsed_s: float) -> str:
    """The end of a job in a few lines: counts, throughput, cost."""
    counts = batch.get("request_counts") or {}
    usage = batch.get("usage") or {}
    meta = batch.get("metadata") or {}
    lines = [
        f"{batch['status']}: {counts.get('completed', 0)} completed, "
        f"{counts.get('failed', 0)} failed of {counts.get('total', 0)} in {elapsed_s:.1f} s",
    ]
    if usage:
        num_tokens = int(usage.get("total_tokens", 0))
        lines.append(
            f"tokens: {usage.get('input_tokens', 0)} in, {usage.get('output_tokens', 0)} out; "
            f"{meta.get('pdserve_tokens_per_s', f'{num_tokens / max(elapsed_s, 1e-9):.1f}')} "
            f"tokens/s ({meta.get('pdserve_output_tokens_per_s', '?')} generated tokens/s)"
        )
    if "pdserve_replica_seconds" in meta:
        lines.append(
            f"cost: {meta['pdserve_replica_seconds']} replica-seconds, "
            f"${meta.get('pdserve_usd', '0')} (${meta.get('pdserve_usd_per_1m_tokens', '?')} "
            "per 1M tokens at the configured prices)"
        )
    return "\n".join(lines)
