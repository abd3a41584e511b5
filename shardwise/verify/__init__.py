"""Proving layouts: verify's reference and layout runs, their per-step and per-tensor comparison, and
localizing where a failing layout first departs."""
