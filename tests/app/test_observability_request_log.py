"""The request log's policy: redaction, rotation by size and age, retention, sampling."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config import RequestLogSettings
from app.observability.request_log import (
    ROTATED_MARKER,
    LogEntry,
    Redactor,
    RequestLog,
    RotatingJsonlFile,
)


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_redactor_builtin_rules() -> None:
    redact = Redactor(["emails", "api_keys", "digits"], min_digits=4)
    text = (
        "mail jane.doe+x@example.co.uk, key sk-abcDEF123456789xyz, card 4111111111111111, "
        "room 42, token a1b2c3d4e5f6a7b8c9d0e1f2a3b4"
    )
    out = redact(text)
    assert "jane.doe" not in out and "example.co.uk" not in out
    assert "sk-abcDEF" not in out
    assert "4111" not in out
    assert "a1b2c3d4e5f6" not in out
    assert "room 42" in out  # fewer digits than the threshold
    assert out.count("[REDACTED:emails]") == 1
    assert out.count("[REDACTED:api_keys]") == 2
    assert out.count("[REDACTED:digits]") == 1


def test_redactor_custom_patterns_and_only_chosen_rules() -> None:
    redact = Redactor(["emails"], patterns=[r"Project\s+\w+"])
    out = redact("Project Falcon by bob@corp.io costs 123456")
    assert out == "[REDACTED:custom] by [REDACTED:emails] costs 123456"


def test_invalid_custom_pattern_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="not a regex"):
        RequestLogSettings(redact_patterns=["(unclosed"])
    with pytest.raises(ValidationError, match="needs request_log.path"):
        RequestLogSettings(enabled=True)


def test_rotates_by_size_and_keeps_whole_lines(tmp_path: Path) -> None:
    clock = FakeClock()
    log = RotatingJsonlFile(tmp_path, "requests-a", 100, 3600, 86400, clock)
    for i in range(10):
        clock.now += 0.001  # distinct rotation stamps
        log.write(json.dumps({"i": i, "pad": "x" * 20}))
    log.close()
    files = sorted(tmp_path.glob("*.jsonl"))
    rotated = [p for p in files if ROTATED_MARKER in p.name]
    assert rotated and (tmp_path / "requests-a.jsonl") in files
    seen = []
    for path in files:
        assert path.stat().st_size <= 100
        seen += [json.loads(line)["i"] for line in path.read_text().splitlines()]
    assert sorted(seen) == list(range(10))


def test_rotates_by_age(tmp_path: Path) -> None:
    clock = FakeClock()
    log = RotatingJsonlFile(tmp_path, "requests-a", 10**9, 60, 86400, clock)
    log.write("{}")
    clock.now += 59
    log.write("{}")
    assert not list(tmp_path.glob(f"*{ROTATED_MARKER}*"))
    clock.now += 1
    log.write("{}")
    log.close()
    (rotated,) = tmp_path.glob(f"*{ROTATED_MARKER}*")
    assert len(rotated.read_text().splitlines()) == 2
    assert len((tmp_path / "requests-a.jsonl").read_text().splitlines()) == 1


def test_retention_deletes_only_old_rotated_files(tmp_path: Path) -> None:
    clock = FakeClock()
    old = tmp_path / f"requests-b{ROTATED_MARKER}20200101T000000000000Z.jsonl"
    fresh = tmp_path / f"requests-b{ROTATED_MARKER}20200102T000000000000Z.jsonl"
    other = tmp_path / "notes.jsonl"
    for path, age in ((old, 7200), (fresh, 60), (other, 10**6)):
        path.write_text("{}\n")
        os.utime(path, (clock.now - age, clock.now - age))
    log = RotatingJsonlFile(tmp_path, "requests-a", 10**9, 3600, 3600, clock)
    assert not old.exists()  # purged at start
    assert fresh.exists() and other.exists()
    clock.now += 3600
    log.write("{}")  # rotation (age) purges again: `fresh` is now past the retention
    log.close()
    assert not fresh.exists() and other.exists()


def _settings(tmp_path: Path, **overrides: object) -> RequestLogSettings:
    return RequestLogSettings.model_validate({"enabled": True, "path": str(tmp_path), **overrides})


def test_request_log_writes_metadata_only_by_default(tmp_path: Path) -> None:
    log = RequestLog(_settings(tmp_path), lambda ids: "secret text 1234567")
    assert not any(log.sample_content() for _ in range(100))
    log.submit(LogEntry({"request_id": "r1", "num_prompt_tokens": 3}, (1, 2, 3), [[4]]))
    assert log.flush()
    log.close()
    (line,) = log.path.read_text().splitlines()
    assert json.loads(line) == {"request_id": "r1", "num_prompt_tokens": 3}


def test_content_logging_is_sampled_and_redacted(tmp_path: Path) -> None:
    texts = {(1, 2): "write to a@b.com", (7,): "pin 98765"}
    log = RequestLog(
        _settings(tmp_path, log_content=True, content_sample_ratio=0.5),
        lambda ids: texts[tuple(ids)],
    )
    draws = [log.sample_content() for _ in range(2000)]
    assert 800 < sum(draws) < 1200  # about half
    log.submit(LogEntry({"request_id": "r2"}, (1, 2), [[7]], with_content=True))
    assert log.flush()
    log.close()
    record = json.loads(log.path.read_text())
    assert record["content"] == {
        "prompt": "write to [REDACTED:emails]",
        "completions": ["pin [REDACTED:digits]"],
    }
