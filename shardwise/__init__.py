"""shardwise: PyTorch-native N-D parallel training of transformer language models.

``shardwise.train``, ``shardwise.load`` and ``shardwise.plan`` (shardwise/api.py) are the commands as
Python calls; they load torch when first used, so ``import shardwise`` stays light."""

import types

from shardwise import plan as _plan_package  # (its __init__ imports nothing)

__version__ = "0.1.0"

_API = ("train", "load", "Run", "Model", "Plan", "ConfigError")


class _CallablePlan(types.ModuleType):
    """``shardwise.plan`` is the planner's package (shardwise/plan/) and, called, :func:`shardwise.api.plan`:
    the import system binds the package to the name whenever a module under it is imported, so the
    call has to live on the package itself."""

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        from shardwise.api import plan

        return plan(*args, **kwargs)


_plan_package.__class__ = _CallablePlan


def __getattr__(name: str):  # noqa: ANN202 - the API's objects, imported on first use
    if name in _API:
        from shardwise import api

        return getattr(api, name)
    raise AttributeError(f"module 'shardwise' has no attribute '{name}'")
