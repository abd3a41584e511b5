"""Optimizer, learning-rate schedules and gradient clipping."""
