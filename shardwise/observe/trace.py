"""Run traces: a compact signature of every module's output and every gradient, per step, and the
first place two traces differ (``--debug.trace FILE``, ``shardwise compare A B``).

Each rank writes one JSON line per step: the forward output of every module in the order the
forward ran them (every call: micro-batches, activation-checkpointing recomputes), then the
gradient of every parameter as the optimizer is about to use it, each as (name, its L2 norm, a
hash of its bytes). A signature is of the rank's local tensor (a DTensor's shard), so traces of the
same layout compare -- two runs, two commits, two machines. Rank 0 writes FILE, rank r > 0
FILE with ``.rank<r>`` after its name.

The bytes' hash tells whether two runs are bitwise equal; the norm, how far they are apart where
they are not. :func:`compare` walks two traces step by step, outputs before gradients, and names
the first signature whose hash differs (or, with a tolerance, whose norm differs by more).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.schema import ConfigError

FORMAT = 1


def rank_path(path: Path, rank: int) -> Path:
    """Where ``rank`` writes the trace named ``path``."""
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")


def taken(path: Path) -> ConfigError:
    """The refusal of a trace file that exists (a trace never replaces a file)."""
    return ConfigError(f"debug.trace: '{path}' exists and a trace never replaces one: name another file")


def signature(t: torch.Tensor) -> tuple[float, str]:
    """(L2 norm, 16 hex digits of a hash of the bytes) of the local tensor."""
    t = t.to_local() if isinstance(t, DTensor) else t
    t = t.detach()
    data = t.reshape(-1).contiguous().view(torch.uint8)  # (1-D: a scalar cannot be viewed as bytes)
    digest = hashlib.blake2b(data.cpu().numpy().tobytes(), digest_size=8).hexdigest()
    return float(t.double().norm()), digest


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from _tensors(x)


class RunTrace:
    """Records one rank's trace: forward hooks on every module, an optimizer pre-step hook for the
    gradients; :meth:`around_step` frames each step (forwards without gradients -- evaluation --
    are not recorded)."""

    def __init__(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                 header: dict[str, Any]) -> None:
        self.path = rank_path(path, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.file = self.path.open("x")  # (exclusive: a trace never replaces a file)
        except FileExistsError:
            raise taken(self.path) from None
        self.file.write(json.dumps({"trace": FORMAT, "rank": rank, **header}) + "\n")
        self.step: int | None = None
        self.outputs: list[list] = []
        self.grads: list[list] = []
        self.params = list(model.named_parameters())
        self.handles = [m.register_forward_hook(self._hook(name or "(model)"))
                        for name, m in model.named_modules()]
        self.handles.append(optimizer.register_step_pre_hook(self._grads))

    def _hook(self, name: str):  # noqa: ANN202 - a forward hook
        def record(module: nn.Module, args: Any, out: Any) -> None:
            if self.step is None or not torch.is_grad_enabled():
                return
            for i, t in enumerate(_tensors(out)):
                self.outputs.append([name if i == 0 else f"{name}[{i}]", *signature(t)])
        return record

    def _grads(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.step is None:
            return
        self.grads = [[name, *signature(p.grad)] for name, p in self.params if p.grad is not None]

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        """Record ``step``: its line is written when the step completes."""
        self.step, self.outputs, self.grads = step, [], []
        try:
            yield
            self.file.write(json.dumps({"step": step, "outputs": self.outputs, "grads": self.grads}) + "\n")
            self.file.flush()
        finally:
            self.step = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.file.close()


# ---------------------------------------------------------------------------------------------
# Comparing two traces


@dataclass(frozen=True)
class Difference:
    step: int
    kind: str
    """``output`` (a module's forward output) or ``grad`` (a parameter's gradient)."""
    name: str
    call: int
    """Which call of the module in the step (0: its first; micro-batches, recomputes)."""
    norm_a: float
    norm_b: float
    before: str
    """The signature before it, which agreed (where the two runs were still the same)."""

    @property
    def rel(self) -> float:
        return abs(self.norm_a - self.norm_b) / max(abs(self.norm_a), abs(self.norm_b), 1e-30)


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, steps) of a trace file; a one-line error if it is not one."""
    if path.is_dir():
        raise ConfigError(f"trace '{path}' is a folder, not a trace file: pass the FILE a run wrote with "
                          "train --debug.trace FILE")
    if not path.is_file():
        raise ConfigError(f"trace '{path}' does not exist: record one with train --debug.trace FILE")
    try:
        lines = path.read_text().splitlines()
        header, steps = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    except (OSError, IndexError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"'{path}' is not a shardwise trace ({type(e).__name__}: {str(e)[:100]}): record "
                          "one with --debug.trace FILE") from None
    if not isinstance(header, dict) or header.get("trace") != FORMAT:
        raise ConfigError(f"'{path}' is not a shardwise trace of format {FORMAT}: record it again with "
                          "--debug.trace FILE")
    for n, row in enumerate(steps, 2):
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)
                and all(isinstance(row.get(k), list) for k in ("outputs", "grads"))):
            raise ConfigError(f"'{path}' line {n} is not a trace step (no integer 'step', 'outputs' and "
                              "'grads'): the file was cut or edited; record it again with --debug.trace FILE")
    return header, steps


def first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]], rtol: float = 0.0
                     ) -> Difference | str | None:
    """The first signature where the steps ``a`` and ``b`` differ (bitwise with ``rtol`` 0, else by
    more than ``rtol`` in norm), a line if their structure differs, or None."""
    before = "(the start)"
    for sa, sb in zip(a, b, strict=False):
        if sa["step"] != sb["step"]:
            return f"the traces record different steps: {sa['step']} and {sb['step']}"
        for kind, key in (("output", "outputs"), ("grad", "grads")):
            calls: dict[str, int] = {}
            for ea, eb in zip(sa[key], sb[key], strict=False):
                if ea[0] != eb[0]:
                    return (f"step {sa['step']}: the runs differ in structure at {kind} of {ea[0]} vs "
                            f"{eb[0]} (another model or layout)")
                call = calls[ea[0]] = calls.get(ea[0], -1) + 1
                differs = ea[2] != eb[2] if rtol == 0 else not math.isclose(ea[1], eb[1], rel_tol=rtol)
                if differs:
                    return Difference(sa["step"], kind, ea[0], call, ea[1], eb[1], before)
                before = f"step {sa['step']} {kind} of {ea[0]}"
            if len(sa[key]) != len(sb[key]):
                return f"step {sa['step']}: {len(sa[key])} vs {len(sb[key])} {key} recorded"
    return None


def compare(a: Path, b: Path, rtol: float = 0.0) -> tuple[bool, str]:
    """(whether ``a`` and ``b`` agree, a report of a few lines). Every rank's file is compared."""
    ranks = sorted({0} | {int(p.name.rsplit(".rank", 1)[1]) for p in a.parent.glob(f"{a.name}.rank*")
                          if p.name.rsplit(".rank", 1)[1].isdigit()})
    lines, same = [], True
    for rank in ranks:
        (ha, sa), (hb, sb) = read_trace(rank_path(a, rank)), read_trace(rank_path(b, rank))
        found = first_difference(sa, sb, rtol)
        who = f"rank {rank}: " if len(ranks) > 1 else ""
        if found is None:
            n = min(len(sa), len(sb))
            what = "bitwise equal" if rtol == 0 else f"equal within rtol {rtol:g}"
            outputs = sum(len(s["outputs"]) for s in sa[:n])
            grads = sum(len(s["grads"]) for s in sa[:n])
            extra = f" (one trace has {abs(len(sa) - len(sb))} more steps)" if len(sa) != len(sb) else ""
            lines.append(f"{who}{what}: {n} steps, {outputs} module outputs, {grads} gradients{extra}")
            continue
        same = False
        if isinstance(found, str):
            lines.append(f"{who}{found}")
            continue
        d = found
        call = f" (call {d.call + 1})" if d.call else ""
        lines.append(f"{who}first difference: step {d.step}, {d.kind} of {d.name}{call}: norm "
                     f"{d.norm_a:.9g} vs {d.norm_b:.9g} (relative {d.rel:.2e})"
                     + ("" if rtol == 0 else f" > rtol {rtol:g}"))
        lines.append(f"{who}  the same up to: {d.before}")
        for h, label in ((ha, "A"), (hb, "B")):
            threads = f", {h['threads']} thread(s)" if "threads" in h else ""  # (GEMM sums depend on it)
            lines.append(f"{who}  {label}: {h.get('layout', '?')} on {h.get('cpu', '?')}{threads}")
    return same, "\n".join(lines)
