"""``torch.profiler`` on a schedule, with traces named by rank and step.

Steps are cut into windows of ``profile.every`` steps from step ``profile.start``; each window
records its last ``profile.active`` steps after ``profile.warmup`` discarded ones, and is written as
``run.dir/traces/rank{R}_step{S}.json`` (Chrome trace format: open it in Perfetto or
chrome://tracing), S being the window's last step, so files from different ranks and windows never
collide. On CUDA the allocator's history is recorded as well and dumped next to it as
``rank{R}_step{S}_memory.pickle`` (open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from shardwise.config.schema import ProfileConfig


class StepProfiler:
    """Call :meth:`step` once per training step, inside ``with``; does nothing when disabled."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device,
                 first_step: int) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.out = run_dir / "traces"
        self.step_no = first_step - 1  # the step just finished
        self._prof: profile | None = None
        if not cfg.enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        # Windows repeat every `every` steps: wait, then warm up, then record `active` steps. The
        # first window starts once `start` steps have run.
        wait = max(cfg.every - cfg.warmup - cfg.active, 0)
        skip = max(cfg.start - first_step, 0)
        self._prof = profile(activities=activities, record_shapes=cfg.record_shapes,
                             profile_memory=cfg.profile_memory, with_stack=False,
                             schedule=schedule(skip_first=skip, wait=wait, warmup=cfg.warmup,
                                               active=cfg.active, repeat=0),
                             on_trace_ready=self._write)

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._prof.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._prof is not None:
            self._prof.__exit__(exc_type, exc, tb)
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)

    def step(self) -> None:
        self.step_no += 1
        if self._prof is not None:
            self._prof.step()

    def trace_path(self, step: int) -> Path:
        return self.out / f"rank{self.rank}_step{step}.json"

    def _write(self, prof: profile) -> None:
        prof.export_chrome_trace(str(self.trace_path(self.step_no)))
        if self.device.type == "cuda":
            snapshot = self.out / f"rank{self.rank}_step{self.step_no}_memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
