"""Loss spikes: a step whose loss stands far above the steps just before it.

A spike is a step (after the learning-rate warm-up) whose global loss exceeds ``factor`` times the
mean of the ``window`` steps before it that were not spikes. Spikes stay out of the reference, so a
run of them is measured against the healthy level; after ``window`` spikes in a row the loss has
moved, and its new level becomes the reference (said once), so a skipping run never stalls.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Spike:
    """One step's verdict: its loss against the reference mean. ``rebased``: this spike was the
    ``window``-th in a row, so their level is the reference from the next step on."""

    step: int
    loss: float
    mean: float
    rebased: bool = False

    @property
    def ratio(self) -> float:
        return self.loss / self.mean

    def describe(self, window: int, windows: list[str], skipped: bool) -> str:
        """The one line a user reads: the step, how far above the mean, and its data windows."""
        what = "its update was skipped" if skipped else "its update was applied"
        moved = (f"; {window} spikes in a row: their level is the reference from here on" if self.rebased
                 else "")
        return (f"step {self.step}: loss spike, {self.loss:.4f} is {self.ratio:.2f}x the mean of the "
                f"{window} steps before it ({self.mean:.4f}); {what}{moved}; its data windows: "
                f"{', '.join(windows)} (see one: shardwise prepare --show-window SOURCE:INDEX)")


class SpikeWatch:
    """The recent losses and the limit a step's loss must stay under (``factor`` 0: never)."""

    def __init__(self, factor: float, window: int, after_step: int) -> None:
        self.factor, self.window, self.after_step = factor, window, after_step
        self.recent: deque[float] = deque(maxlen=window)
        self.streak: list[float] = []  # the losses of the spikes in a row so far

    def limit(self, step: int) -> float:
        """The largest loss ``step`` may have without being a spike (inf: not judged)."""
        if not self.factor or step <= self.after_step or len(self.recent) < self.window:
            return math.inf
        return self.factor * sum(self.recent) / len(self.recent)

    def add(self, step: int, loss: float) -> Spike | None:
        """Record ``step``'s loss; the spike it is, if it is one. A loss that is not finite is the
        non-finite check's (training.nonfinite), not a spike."""
        limit = self.limit(step)
        if not math.isfinite(loss):
            return None
        if loss <= limit:
            self.recent.append(loss)
            self.streak = []
            return None
        self.streak.append(loss)
        rebased = len(self.streak) == self.window
        if rebased:
            self.recent.extend(self.streak)
            self.streak = []
        return Spike(step, loss, limit / self.factor, rebased)
