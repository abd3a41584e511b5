"""Fused / custom ops, each tested against the plain PyTorch computation."""
