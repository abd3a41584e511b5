"""lm-evaluation-harness on a shardwise model: ``shardwise eval --tasks NAMES [--tasks-path DIR]``.

The adapter answers the harness's three kinds of request with the model :func:`generate.load_for_generation`
gives (a checkpoint, a run's latest, or an HF folder), on one device or data parallel over ranks:

- ``loglikelihood``: the log-probability of a continuation after a context, and whether greedy
  decoding would have produced it -- tokenized as the harness's own Hugging Face backend does: the
  context's trailing spaces moved to the continuation, the pair encoded whole without special
  tokens, the continuation the tokens after the context's, an empty context the begin-of-text token.
- ``loglikelihood_rolling``: a whole text's log-probability after the begin-of-text token, in
  windows of the model's context.

Both run ``--batch-size`` sequences per forward, longest first (right-padded, which causal
attention keeps out of every real position).
- ``generate_until``: greedy continuation up to a stop string or the request's token limit.

``--tasks-path`` adds a folder of task YAML files (the harness's own format), so a task can be local
files and run offline. lm-eval is optional (``pip install shardwise[eval]``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch

from shardwise.config.extras import require_extra
from shardwise.config.schema import ConfigError
from shardwise.infer.generate import Loaded, Sampling, generate


def _score(model: torch.nn.Module, items: list[tuple[list[int], int]], batch_size: int
           ) -> list[tuple[float, bool]]:
    """Each (ids, n): the log-probability of the last ``n`` tokens of ``ids`` after the ones before,
    and whether greedy decoding picks every one of them. Sequences of similar length share a
    forward: right-padded, which causal attention keeps out of every real position."""
    device = next(model.parameters()).device
    out: list[tuple[float, bool]] = [(0.0, False)] * len(items)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = len(items[rows[0]][0]) - 1  # (the last token is a target only)
        x = torch.zeros(len(rows), width, dtype=torch.long)  # (B, W)
        for r, i in enumerate(rows):
            ids = items[i][0]
            x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
        with torch.no_grad():
            logits = model(x.to(device))  # (B, W, V)
        totals, greedy = [], []
        for r, i in enumerate(rows):
            ids, n = items[i]
            lp = logits[r, len(ids) - 1 - n:len(ids) - 1].float().log_softmax(-1)  # (n, V)
            target = torch.tensor(ids[-n:], device=lp.device)
            totals.append(lp.gather(1, target[:, None]).sum())
            greedy.append((lp.argmax(-1) == target).all())
        for i, t, g in zip(rows, torch.stack(totals).tolist(), torch.stack(greedy).tolist(), strict=True):
            out[i] = (t, bool(g))  # (one host sync per batch)
    return out


def _windows(ids: list[int], limit: int) -> list[tuple[list[int], int]]:
    """A whole text's (ids, n) windows of at most ``limit`` inputs, each scoring only new tokens."""
    out, start = [], 1
    while start < len(ids):
        end = min(len(ids), start + limit)
        out.append((ids[max(0, end - limit - 1):end], end - start))
        start = end
    return out


def _adapter(loaded: Loaded, batch_size: int = 16) -> Any:
    """An ``lm_eval.api.model.LM`` answering with ``loaded``'s model (lm-eval imported here: it is
    an optional dependency). Log-likelihood requests run ``batch_size`` at a time, longest first;
    under a process group of several ranks each rank answers its share of the requests (the
    harness splits them, and gathers the metrics through :meth:`gather_object`)."""
    import torch.distributed as dist
    from lm_eval.api.model import LM

    model, tok, limit = loaded.model, loaded.tokenizer, loaded.model.args.max_seq_len

    def encode(text: str) -> list[int]:
        return tok.encode_batch([text])[0]  # (no special tokens)

    class ShardwiseLM(LM):
        def __init__(self) -> None:
            super().__init__()
            if dist.is_initialized():
                self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

        @property
        def device(self) -> torch.device:
            return next(model.parameters()).device

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor)  # all-gather over the ranks
            return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

        def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
            parts = [None] * self.world_size if self.rank == dst else None
            dist.gather_object(obj, parts, dst=dst)
            return parts

        def barrier(self) -> None:
            dist.barrier()

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            items = []
            for req in requests:
                context, continuation = req.args
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                whole = encode(context + continuation)
                ctx = encode(context) if context else [tok.bos_id]
                whole = whole if context else [tok.bos_id, *whole]
                n = len(whole) - len(ctx)
                if n < 1:
                    raise ConfigError(f"lm-eval: the continuation {continuation!r} adds no token")
                items.append((whole[-(limit + 1):], n))
            return _score(model, items, batch_size)

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            items, owner = [], []
            for k, req in enumerate(requests):
                windows = _windows([tok.bos_id, *encode(req.args[0])], limit)
                items += windows
                owner += [k] * len(windows)
            out = [0.0] * len(requests)
            for k, (total, _) in zip(owner, _score(model, items, batch_size), strict=True):
                out[k] += total
            return out

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            out = []
            for req in requests:
                context, kwargs = req.args
                until = kwargs.get("until", [])
                until = [until] if isinstance(until, str) else list(until)
                prompt = tok.encode_prompt(context)
                n = min(int(kwargs.get("max_gen_toks", 256)), limit - len(prompt))
                if n < 1:
                    raise ConfigError(f"lm-eval: a prompt of {len(prompt)} tokens fills the model's context")
                text = tok.decode(generate(model, prompt, Sampling(max_new_tokens=n), loaded.stop))
                cut = min([text.index(u) for u in until if u in text], default=len(text))
                out.append(text[:cut])
            return out

    return ShardwiseLM()


def task_manager(tasks: list[str], tasks_path: str = "") -> Any:
    """lm-eval's task index, once every name in ``tasks`` is found there (before any model is
    loaded); one line for a missing lm-eval, a missing --tasks-path or an unknown task."""
    if not tasks:
        raise ConfigError("--tasks is empty: name lm-evaluation-harness tasks, e.g. --tasks hellaswag")
    if tasks_path and not Path(tasks_path).is_dir():
        raise ConfigError(f"--tasks-path '{tasks_path}' is not a folder: give a folder of task YAML files")
    require_extra("eval", f"--tasks {','.join(tasks)} (lm-evaluation-harness, which looks up and runs them)")
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=tasks_path or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        near = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        where = (f" (nor in --tasks-path {tasks_path})" if tasks_path
                 else " (--tasks-path adds a folder of them)")
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise ConfigError(f"--tasks: lm-eval has no task {', '.join(unknown)}{where}{hint}")
    return manager


def run_tasks(loaded: Loaded, tasks: list[str], manager: Any, limit: int | None = None,
              num_fewshot: int | None = None, batch_size: int = 16) -> dict[str, dict[str, Any]] | None:
    """The harness's metrics of each task (name -> {metric: value}) for ``loaded``'s model
    (``manager``: :func:`task_manager`'s); under a process group, on rank 0 (None elsewhere)."""
    from lm_eval import simple_evaluate

    result = simple_evaluate(model=_adapter(loaded, batch_size), tasks=tasks, task_manager=manager,
                             limit=limit, num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0,
                             verbosity="ERROR")
    if result is None:  # (a rank other than 0: its share went to rank 0)
        return None
    return {name: {k: v for k, v in metrics.items() if k != "alias" and not k.endswith("_stderr,none")}
            for name, metrics in result["results"].items()}
