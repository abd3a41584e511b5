"""The optional features and the package each needs: one table, so a missing one is one line naming
the ``pip install`` to run, said before any work starts (pyproject.toml's extras match it:
tests/unit/test_packaging.py)."""

from __future__ import annotations

import importlib.util

from shardwise.config_types import ConfigError

EXTRAS = {"float8": "torchao", "parquet": "pyarrow", "wandb": "wandb", "eval": "lm_eval"}
"""shardwise extra -> the module it installs."""


def require_extra(extra: str, why: str) -> None:
    """Refuse, in one line, what needs the ``extra`` when its module is not installed. ``why``: the
    setting or input that needs it (``"float8.enabled=true"``)."""
    module = EXTRAS[extra]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{why} needs the {module} package: pip install 'shardwise[{extra}]'")
