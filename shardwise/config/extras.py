"""The optional features and the package each needs: one table, so a missing one is one line naming
the ``pip install`` to run, said before any work starts (pyproject.toml's extras match it:
tests/unit/test_packaging.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

from shardwise.config.types import ConfigError

EXTRAS = {"float8": "torchao", "parquet": "pyarrow", "wandb": "wandb", "mlflow": "mlflow",
          "eval": "lm_eval"}
"""shardwise extra -> the module it installs."""


def plan_without_float8(cfg: Any) -> str:
    """The planner with ``float8.enabled`` and no torchao: it plans (and writes) the run without
    float8 rather than refusing -- the preset TOMLs of the GPU runs enable it, and a plan needs no
    GPU -- and returns the notice saying so ("" when nothing changed)."""
    if not cfg.float8.enabled or installed("float8"):
        return ""
    cfg.float8.enabled = False
    return ("float8.enabled needs the torchao package, which is not installed: planning without float8 "
            "(float8.enabled = false); pip install 'shardwise[float8]' to plan and train with it")


def installed(extra: str) -> bool:
    """Whether the ``extra``'s module can be imported."""
    return importlib.util.find_spec(EXTRAS[extra]) is not None


def require_extra(extra: str, why: str) -> None:
    """Refuse, in one line, what needs the ``extra`` when its module is not installed. ``why``: the
    setting or input that needs it (``"float8.enabled=true"``)."""
    module = EXTRAS[extra]
    if not installed(extra):
        raise ConfigError(f"{why} needs the {module} package: pip install 'shardwise[{extra}]'")
