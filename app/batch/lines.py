"""A batch's lines: the input file parsed into requests, results turned into output lines.

An input line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}`. A line that is not such an object (or repeats a `custom_id`) becomes an
error result right away; its body is checked when it runs, as an online request's is. Each
finished line is one result record (`index`, `custom_id`, `status_code`, `body`, token
counts); the output file holds the 2xx ones and the error file the rest, in input order:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200,
     "request_id": ..., "body": {...}}, "error": null}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.errors import BadRequestError, error_body

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class InputLine:
    """One well-formed request line; `index` counts non-blank lines from 0."""

    index: int
    custom_id: str
    body: dict[str, Any]


def count_lines(data: bytes) -> int:
    """Non-blank lines of an input file (its requests, well-formed or not)."""
    return sum(1 for raw in data.split(b"\n") if raw.strip())


def check_input(data: bytes, max_lines: int) -> int:
    """The number of requests in a batch input file; `BadRequestError` when it has none or
    more than `max_lines`."""
    num_lines = count_lines(data)
    if num_lines == 0:
        raise BadRequestError("the input file holds no request", param="input_file_id")
    if num_lines > max_lines:
        raise BadRequestError(
            f"the input file holds {num_lines} requests; a batch takes at most {max_lines}",
            param="input_file_id",
            code="too_many_requests",
        )
    return num_lines


def parse_input(data: bytes, endpoint: str) -> tuple[list[InputLine], list[dict[str, Any]]]:
    """The well-formed lines, and an error result for each other one."""
    lines: list[InputLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    index = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        custom_id: str | None = None
        try:
            item = json.loads(raw)
            if not isinstance(item, dict):
                raise ValueError("a line must be a JSON object")
            custom_id = _custom_id(item.get("custom_id"), seen)
            _check_request(item, endpoint)
            lines.append(InputLine(index, custom_id, item["body"]))
        except ValueError as exc:  # json.JSONDecodeError is one
            message = f"line {number}: {exc}"
            errors.append(
                result(
                    index,
                    custom_id,
                    400,
                    error_body(message, "invalid_request_error", code="invalid_request"),
                )
            )
        index += 1
    return lines, errors


def _custom_id(value: Any, seen: set[str]) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("custom_id must be a non-empty string")
    if value in seen:
        raise ValueError(f"custom_id {value!r} repeats an earlier line's")
    seen.add(value)
    return value


def _check_request(item: Mapping[str, Any], endpoint: str) -> None:
    if item.get("method") != "POST":
        raise ValueError('method must be "POST"')
    if item.get("url") != endpoint:
        raise ValueError(f"url must be the batch's endpoint {endpoint!r}")
    if not isinstance(item.get("body"), dict):
        raise ValueError("body must be a JSON object")


def result(
    index: int,
    custom_id: str | None,
    status_code: int,
    body: Mapping[str, Any],
    request_id: str | None = None,
    num_prompt_tokens: int = 0,
    num_output_tokens: int = 0,
) -> dict[str, Any]:
    """One finished line's record in the job's result log."""
    return {
        "index": index,
        "custom_id": custom_id,
        "status_code": status_code,
        "body": dict(body),
        "request_id": request_id,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
    }


def is_success(record: Mapping[str, Any]) -> bool:
    return 200 <= int(record["status_code"]) < 300


def output_line(batch_id: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """A result record as a line of the output or error file."""
    request_id = record.get("request_id") or f"{batch_id}-{record['index']}"
    return {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{record['index']}",
        "custom_id": record["custom_id"],
        "response": {
            "status_code": record["status_code"],
            "request_id": request_id,
            "body": record["body"],
        },
        "error": None,
    }


def output_files(
    batch_id: str, records: Iterable[Mapping[str, Any]]
) -> tuple[bytes, bytes, int, int]:
    """(output file, error file, number of each), lines in input order."""
    ok: list[bytes] = []
    failed: list[bytes] = []
    for record in sorted(records, key=lambda r: int(r["index"])):
        line = json.dumps(output_line(batch_id, record), separators=(",", ":")).encode()
        (ok if is_success(record) else failed).append(line + b"\n")
    return b"".join(ok), b"".join(failed), len(ok), len(failed)
