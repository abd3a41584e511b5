"""shardwise: PyTorch-native N-D parallel training of transformer language models.

``shardwise.train``, ``load``, ``plan``, ``verify``, ``estimate``, ``eval``, ``prepare``, ``convert`` and
``download`` (shardwise/api.py) are the commands as Python calls; they load torch when first used, so
``import shardwise`` stays light."""

import types

from shardwise import plan as _plan_package  # (their __init__s import nothing)
from shardwise import verify as _verify_package

__version__ = "0.1.0"

_API = ("train", "load", "estimate", "eval", "prepare", "convert", "download", "Run", "Model", "Plan",
        "Evaluation", "Prepared", "Converted", "Downloaded", "ConfigError")


class _CallablePackage(types.ModuleType):
    """``shardwise.plan`` and ``shardwise.verify`` are packages (shardwise/plan/, shardwise/verify/)
    and, called, :func:`shardwise.api.plan` and :func:`shardwise.api.verify`: the import system
    binds a package to its name whenever a module under it is imported, so the call has to live on
    the package itself."""

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        from shardwise import api

        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


_plan_package.__class__ = _CallablePackage
_verify_package.__class__ = _CallablePackage


def __getattr__(name: str):  # noqa: ANN202 - the API's objects, imported on first use
    if name in _API:
        from shardwise import api

        return getattr(api, name)
    raise AttributeError(f"module 'shardwise' has no attribute '{name}'")
