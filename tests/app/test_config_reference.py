"""`docs/configuration.md` is what `scripts/config_reference.py` generates from the config
models now: a field added, renamed or re-described without regenerating it fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "config_reference.py"


def test_the_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = module.OUTPUT.read_text()
    assert current == module.render(), (
        "docs/configuration.md is stale: run python scripts/config_reference.py"
    )
