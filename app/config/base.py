"""The base of every config model (unknown keys are errors), the config error, and API
keys read from their sources (inline, environment, file).
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,62}$"


class ConfigError(ValueError):
    """A configuration file cannot be read or does not have the expected shape."""


class _Strict(BaseModel):
    """Base of every config model: unknown keys (typos) are errors."""

    model_config = ConfigDict(extra="forbid")


def _check_inline_keys(value: list[str]) -> list[str]:
    if any(not key or key != key.strip() for key in value):
        raise ValueError("API keys must be non-empty and have no surrounding whitespace")
    if len(set(value)) != len(value):
        raise ValueError("API keys must not repeat")
    return value


def read_api_keys(inline: list[str], env: str | None, path: str | None, owner: str) -> list[str]:
    """The keys of one owner (a tenant, or the admins) from every source it names.

    `env` names an environment variable holding keys separated by commas or whitespace;
    `path` a file with one key per line (blank lines and `#` comments skipped). Both are
    read where this runs (the ingress replica), so the keys never travel in the app args.
    Raises `ConfigError` when a named source is missing or empty.
    """
    keys = list(inline)
    if env is not None:
        value = os.environ.get(env)
        if not value or not value.strip():
            raise ConfigError(f"{owner}: environment variable {env!r} is unset or empty")
        keys += value.replace(",", " ").split()
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as e:
            raise ConfigError(f"{owner}: cannot read API key file {path!r}: {e}") from e
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ConfigError(f"{owner}: API key file {path!r} holds no key")
        keys += from_file
    return list(dict.fromkeys(keys))
