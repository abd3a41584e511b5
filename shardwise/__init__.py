"""shardwise: PyTorch-native N-D parallel training of transformer language models.

``shardwise.train``, ``shardwise.load`` (shardwise/api.py) are the commands as Python calls; they
load torch when first used, so ``import shardwise`` stays light."""

__version__ = "0.1.0"

_API = ("train", "load", "Run", "Model", "ConfigError")


def __getattr__(name: str):  # noqa: ANN202 - the API's objects, imported on first use
    if name in _API:
        from shardwise import api

        return getattr(api, name)
    raise AttributeError(f"module 'shardwise' has no attribute '{name}'")
