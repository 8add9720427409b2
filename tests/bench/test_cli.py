"""The benchmarks by name (`bench/cli.py`): every entry runs a module's `main`, `--help`
lists every benchmark, and a benchmark gets every argument after its name."""

from __future__ import annotations

import importlib

import pytest

from bench import cli


@pytest.mark.parametrize("name", sorted(cli.BENCHES))
def test_every_benchmark_has_a_main(name: str) -> None:
    module = importlib.import_module(cli.BENCHES[name].module)
    assert callable(module.main)


def test_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for name, bench in cli.BENCHES.items():
        assert f"  {name} " in out and bench.summary in out


def test_unknown_or_missing_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["nope"], [], ["--json"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_arguments_after_the_name_go_to_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["transfer", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pdserve bench transfer") and "--backend" in out
