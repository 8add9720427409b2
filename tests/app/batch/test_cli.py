"""`pdserve batch`'s arguments: the service's `--url` and `--api-key` go before the action or
after it (README and docs write `pdserve batch submit in.jsonl --url ... --wait`); given in
both places, the later one wins; left out, their defaults."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from app.batch.cli import build_parser


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "in.jsonl", "--url", "http://h:1", "--api-key", "sk-a", "--wait"],
        ["--url", "http://h:1", "--api-key", "sk-a", "submit", "in.jsonl", "--wait"],
        [
            "--url",
            "http://other:2",
            "submit",
            "in.jsonl",
            "--url",
            "http://h:1",
            "--wait",
            "--api-key",
            "sk-a",
        ],
    ],
)
def test_service_options_before_or_after_the_action(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.action, str(args.input), args.wait) == ("submit", "in.jsonl", True)
    assert (args.url, args.api_key) == ("http://h:1", "sk-a")


@pytest.mark.parametrize("action", ["status", "cancel"])
def test_defaults_when_left_out(action: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    args = build_parser().parse_args([action, "batch_1"])
    assert (args.url, args.api_key, args.batch_id) == ("http://127.0.0.1:8000", "sk-env", "batch_1")
    after = build_parser().parse_args([action, "batch_1", "--url", "http://h:1"])
    assert (after.url, after.api_key) == ("http://h:1", "sk-env")


def test_unknown_options_are_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["submit", "in.jsonl", "--nope"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md"])
def test_the_documented_commands_parse(doc: str) -> None:
    """Every `pdserve batch ...` command line the docs show is one this parser takes, with
    the service's address it names."""
    root = Path(__file__).resolve().parents[3]
    lines = [
        line.strip()
        for line in (root / doc).read_text(encoding="utf-8").splitlines()
        if line.strip().startswith("pdserve batch ")
    ]
    assert lines, f"{doc} shows no `pdserve batch` command"
    for line in lines:
        argv = shlex.split(line.replace("$KEY", "sk-key"))[2:]
        args = build_parser().parse_args(argv)
        if "--url" in argv:
            assert args.url == argv[argv.index("--url") + 1], line
