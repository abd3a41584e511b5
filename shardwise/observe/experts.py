"""MoE routing health: each MoE block's expert load, and the notice that its routing has collapsed.

A block's load is its busiest expert's routed slots over the mean (1.0 = balanced; top-k of E
experts allows at most E/k). Collapse is a block whose load stays above :data:`COLLAPSE_LOAD` for
:data:`COLLAPSE_STEPS` steps running: a few experts then take most tokens and the rest stop learning,
which balancing exists to prevent. A single busy step is routine early in training and says nothing.
"""

from __future__ import annotations

COLLAPSE_LOAD = 3.0
"""A block's load above which a step counts towards collapse."""
COLLAPSE_STEPS = 10
"""Steps running above :data:`COLLAPSE_LOAD` that make a collapse."""


class CollapseWatch:
    """Per MoE block, the steps in a row its load was above ``load``; said once per episode."""

    def __init__(self, n_experts: int, top_k: int, load: float = COLLAPSE_LOAD,
                 steps: int = COLLAPSE_STEPS) -> None:
        self.most = n_experts / max(1, top_k)  # every slot on the top-k experts
        self.load, self.steps = load, steps
        self.running: dict[str, int] = {}

    def add(self, step: int, loads: dict[str, float]) -> str | None:
        """Record ``step``'s loads ({block: load}); the notice to print, if a block has just collapsed."""
        collapsed = []
        for block, value in loads.items():
            n = self.running.get(block, 0) + 1 if value > self.load else 0
            self.running[block] = n
            if n == self.steps:
                collapsed.append(block)
        if not collapsed:
            return None
        worst = max(loads[b] for b in collapsed)
        which = ", ".join(collapsed)
        return (f"step {step}: MoE routing collapsed in block{'s' if len(collapsed) > 1 else ''} {which}: "
                f"the busiest expert took over {self.load:g}x its share of tokens for {self.steps} steps "
                f"running (now {worst:.2f}x; {self.most:g}x = every token on the same experts); per-block "
                "loads are expert_load_layers in metrics.jsonl; balancing: docs/models.md, 'Keeping MoE "
                "balanced'")
