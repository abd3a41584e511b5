"""lm-evaluation-harness on a shardwise model: ``shardwise eval --tasks NAMES [--tasks-path DIR]``.

The adapter answers the harness's three kinds of request with the model :func:`generate.load_for_generation`
gives (a checkpoint, a run's latest, or an HF folder, on one device):

- ``loglikelihood``: the log-probability of a continuation after a context, and whether greedy
  decoding would have produced it -- tokenized as the harness's own Hugging Face backend does: the
  context's trailing spaces moved to the continuation, the pair encoded whole without special
  tokens, the continuation the tokens after the context's, an empty context the begin-of-text token.
- ``loglikelihood_rolling``: a whole text's log-probability after the begin-of-text token, in
  windows of the model's context.
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


def _adapter(loaded: Loaded) -> Any:
    """An ``lm_eval.api.model.LM`` answering with ``loaded``'s model (lm-eval imported here: it is
    an optional dependency)."""
    from lm_eval.api.model import LM

    model, tok = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    limit = model.args.max_seq_len

    def encode(text: str) -> list[int]:
        return tok.encode_batch([text])[0]  # (no special tokens)

    def logprobs(ids: list[int]) -> torch.Tensor:
        """(len(ids) - 1, vocab) log-probabilities of each next token."""
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device))[0, :-1].float()
        return logits.log_softmax(-1)

    class ShardwiseLM(LM):
        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            out = []
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
                ids = whole[-(limit + 1):]
                lp = logprobs(ids)[-n:]  # (n, vocab): the continuation's positions
                target = torch.tensor(ids[-n:], device=lp.device)
                total = lp.gather(1, target[:, None]).sum().item()
                out.append((total, bool((lp.argmax(-1) == target).all())))
            return out

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            out = []
            for req in requests:
                ids = [tok.bos_id, *encode(req.args[0])]
                total, start = 0.0, 1
                while start < len(ids):  # windows of the context, each predicting new tokens only
                    end = min(len(ids), start + limit)
                    window = ids[max(0, end - limit - 1):end]
                    lp = logprobs(window)[-(end - start):]
                    target = torch.tensor(ids[start:end], device=lp.device)
                    total += lp.gather(1, target[:, None]).sum().item()
                    start = end
                out.append(total)
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
              num_fewshot: int | None = None) -> dict[str, dict[str, Any]]:
    """The harness's metrics of each task (name -> {metric: value}) for ``loaded``'s model
    (``manager``: :func:`task_manager`'s)."""
    from lm_eval import simple_evaluate

    result = simple_evaluate(model=_adapter(loaded), tasks=tasks, task_manager=manager, limit=limit,
                             num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0,
                             verbosity="ERROR")
    return {name: {k: v for k, v in metrics.items() if k != "alias" and not k.endswith("_stderr,none")}
            for name, metrics in result["results"].items()}
