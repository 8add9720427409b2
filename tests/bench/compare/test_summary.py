"""`pdserve bench summary`: the config x workload table over `bench compare` files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.compare import store as compare_store
from bench.compare import summary as compare_summary
from bench.goodput.knee import interpolate_goodput


def _run(config: str, seed: int, points: list[tuple[float, int]]) -> dict[str, Any]:
    """A finished run whose points met `met` of 100 requests at each rate."""
    estimate = interpolate_goodput([(rate, met / 100) for rate, met in points], 0.9)
    return {
        "config": config,
        "seed": seed,
        "noisy": False,
        "goodput": {"goodput": estimate.goodput, "bracketed": estimate.bracketed},
        "points": [
            {"rate": rate, "attainment": met / 100, "classes": {"all": {"met": met, "n": 100}}}
            for rate, met in points
        ],
    }


def _document(complete: bool = True) -> dict[str, Any]:
    runs = {
        # adaptive: 1.0 at seed 0, 2.0 at seed 1
        "a": [_run("a", 0, [(1.0, 90), (2.0, 0)]), _run("a", 1, [(2.0, 90), (4.0, 0)])],
        # disagg: 2.0 then 1.0; colocated: 0.5 then 1.5 (best other: d, then c)
        "d": [_run("d", 0, [(2.0, 90), (4.0, 0)]), _run("d", 1, [(1.0, 90), (2.0, 0)])],
        "c": [_run("c", 0, [(0.5, 90), (1.0, 0)]), _run("c", 1, [(1.5, 90), (3.0, 0)])],
    }
    document: dict[str, Any] = {
        "settings": {"configs": "a,d,c"},
        "workload": {"workload": "mixed"},
        "model": "small",
        "target": 0.9,
        "complete": complete,
        "slo": None,
        "runs": runs,
    }
    return document


def test_table_pairs_seeds_and_divides_by_the_best_other_config() -> None:
    summary = compare_summary.summarize(_document(), num_resamples=200)
    assert summary["seeds"] == [0, 1]
    assert summary["goodput"]["a"]["mean"] == pytest.approx(1.5)
    assert summary["ratios"]["d"]["ratio"] == pytest.approx(1.5 / 1.0)
    best = summary["vs_best"]
    # per seed: a over the better of d and c at that seed (2.0, then 1.5)
    assert best["per_seed"] == pytest.approx([1.0 / 2.0, 2.0 / 1.5])
    assert best["best_other"] == "d" and best["ratio"] == pytest.approx(1.5 / 1.5)
    low, high = best["ci_paired"]
    assert low <= 0.5 + 1e-9 and high >= 4 / 3 - 1e-9  # seeds resampled jointly
    table = compare_summary.markdown([summary])
    assert "| mixed (`small`) | - | 0,1 | `a` | 1.500 ± 0.707 |" in table
    assert "1.00× vs `d`" in table and "baseline" in table


def test_partial_file_uses_seeds_every_config_finished_and_shows_searches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = _document(complete=False)
    document["runs"]["c"] = document["runs"]["c"][:1]  # c has not finished seed 1
    document["in_progress"] = [
        {"config": "c", "seed": 1, "points": [{"rate": 1.5, "attainment": 0.95}]}
    ]
    path = tmp_path / "compare-mixed.json"
    path.write_text(json.dumps(document))
    out = tmp_path / "summary.json"
    plot = tmp_path / "summary.png"
    assert compare_summary.main([str(path), "--json", str(out), "--plot", str(plot)]) == 0
    (summary,) = json.loads(out.read_text())
    assert summary["seeds"] == [0] and summary["goodput"]["a"]["per_run"] == [1.0]
    assert summary["in_progress"][0]["bracket"] == [1.5, None]  # nothing failed yet
    unpaired = [(run["config"], run["seed"]) for run in summary["unpaired"]]
    assert unpaired == [("a", 1), ("d", 1)]  # finished where c has not
    printed = capsys.readouterr().out
    assert "| mixed (`small`, partial) | compare-mixed.json | 1 (in progress) | `c`" in printed
    assert "| 1 (finished, unpaired) | `a` | 2.000, bracket [2, 4] |" in printed
    assert plot.stat().st_size > 0


def test_plot_legend_names_every_config_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that first appears in a later workload (another file's configs) still gets
    its legend entry, and no config gets two."""
    from matplotlib.figure import Figure

    first = compare_summary.summarize(_document(), num_resamples=50)
    other = _document()
    other["settings"]["configs"] = "x,c"
    other["runs"] = {"x": other["runs"]["a"], "c": other["runs"]["c"]}
    second = compare_summary.summarize(other, num_resamples=50)
    legends: list[list[str]] = []

    def save(figure: Figure, *args: Any, **kwargs: Any) -> None:
        legends.append([t.get_text() for ax in figure.axes for t in ax.get_legend().get_texts()])

    monkeypatch.setattr(Figure, "savefig", save)
    compare_summary.plot([first, second], tmp_path / "summary.png")
    assert legends == [["a", "d", "c", "x"]]


def test_gzip_compressed_file_reads_as_the_plain_one(tmp_path: Path) -> None:
    """Committed comparisons are kept as `.json.gz`: written and read back compressed, with
    plots named without either suffix, and summarized the same as the plain file."""
    document = _document(complete=True)
    plain, packed = tmp_path / "compare-mixed.json", tmp_path / "compare-mixed.json.gz"
    compare_store.save_json(plain, document)
    compare_store.save_json(packed, document)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic number
    assert packed.stat().st_size < plain.stat().st_size
    assert compare_store.load_json(packed) == compare_store.load_json(plain)
    assert compare_store.stem(packed) == compare_store.stem(plain) == "compare-mixed"
    out_plain, out_packed = tmp_path / "plain.json", tmp_path / "packed.json"
    assert compare_summary.main([str(plain), "--json", str(out_plain)]) == 0
    assert compare_summary.main([str(packed), "--json", str(out_packed)]) == 0
    strip = [{k: v for k, v in s.items() if k != "file"} for s in json.loads(out_plain.read_text())]
    assert strip == [
        {k: v for k, v in s.items() if k != "file"} for s in json.loads(out_packed.read_text())
    ]
