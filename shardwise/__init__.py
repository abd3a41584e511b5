"""shardwise: PyTorch-native N-D parallel training of transformer language models."""

__version__ = "0.1.0"
