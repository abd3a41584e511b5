"""``shardwise chat``: a conversation with a checkpoint or a Hugging Face model, on its own chat
template, streaming each reply as it is made.

Each turn renders the whole conversation with the template (as training and ``generate --messages``
do) and runs through the model only what the KV cache does not already hold: the cache keeps every
token of the conversation so far, and a turn reuses its longest common prefix with the new
rendering. A template that renders earlier turns differently once a new one follows (Qwen3 drops
earlier replies' thinking) costs a recompute from the first difference, never a wrong context.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardwise.config.schema import ConfigError
from shardwise.infer.generate import Loaded, Sampling, continue_tokens, from_flags, prompt_ids, sampler
from shardwise.models.transformer import KVCache

COMMANDS = {"/reset": "start a new conversation (the system prompt stays)", "/exit": "leave (or Ctrl-D)"}


@dataclass(frozen=True)
class Turn:
    """What one reply cost: prompt tokens run through the model, those reused from the cache, tokens
    generated, and the seconds it took."""

    ran: int
    reused: int
    generated: int
    seconds: float


class Conversation:
    """The messages so far and a KV cache holding their tokens."""

    def __init__(self, loaded: Loaded, s: Sampling, system: str = "", context: int = 4096) -> None:
        if loaded.tokenizer.chat is None:
            raise ConfigError("chat needs a tokenizer with a chat template; this one has none (pass "
                              "--tokenizer with the model's chat tokenizer folder)")
        self.loaded, self.s, self.system = loaded, s, system
        self.device = next(loaded.model.parameters()).device
        self.generator = sampler(s, self.device)
        # (room for ``context`` tokens in every block, allocated up front: a model's full context --
        # 40,960 for Qwen3 -- would cost gigabytes of keys and values that a chat rarely uses)
        self.cache = KVCache(min(context, loaded.model.args.max_seq_len))
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.held: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.cache.length = 0

    def reply(self, text: str, emit: Callable[[str], None]) -> Turn:
        """The model's answer to ``text``, streamed through ``emit`` piece by piece as it is made."""
        start = time.perf_counter()
        tok, stop = self.loaded.tokenizer, self.loaded.stop
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = prompt_ids(tok, messages=messages)
        room = self.cache.max_len - len(ids)
        if room < 1:
            raise ConfigError(f"the conversation is {len(ids)} tokens, the chat's context "
                              f"{self.cache.max_len} (--context): /reset to start a new one")
        s = Sampling(min(self.s.max_new_tokens, room), self.s.temperature, self.s.top_k, self.s.top_p,
                     self.s.seed)
        # (the last prompt token always runs: the next token's logits are its)
        keep = min(len(os.path.commonprefix([self.held, ids])), len(ids) - 1)
        self.cache.length = keep  # what follows the common prefix is overwritten
        out: list[int] = []
        shown = ""
        try:
            for t in continue_tokens(self.loaded.model, self.cache, ids[keep:], s, stop, self.generator):
                out.append(t)
                words = tok.decode([x for x in out if x not in stop])
                if not words.endswith("\ufffd"):  # (a character whose bytes are still coming waits)
                    emit(words[len(shown):])
                    shown = words
        except KeyboardInterrupt:  # Ctrl-C stops this reply; the conversation stays as it was
            self.held, self.cache.length = ids[:keep], keep
            raise
        answer = tok.decode([x for x in out if x not in stop])
        emit(answer[len(shown):])
        self.held = ids + out[:-1]  # every chosen token but the last went through the model
        assert self.cache.length == len(self.held)
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        return Turn(len(ids) - keep, keep, len(out), time.perf_counter() - start)


def chat_command(args: argparse.Namespace, extra: list[str]) -> int:
    if args.context < 2:
        raise ConfigError(f"--context must be >= 2 tokens, got {args.context}")
    s, loaded = from_flags(args, extra)
    talk = Conversation(loaded, s, args.system, args.context)
    tty = sys.stdin.isatty()
    print(f"chatting with {loaded.source} ({', '.join(f'{c}: {w}' for c, w in COMMANDS.items())})",
          flush=True)
    while True:
        try:
            line = input("you> ") if tty else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not tty and not line:  # end of piped input
            return 0
        line = line.strip()
        if line == "/exit":
            return 0
        if line == "/reset":
            talk.reset()
            print("(a new conversation)", flush=True)
            continue
        if not line:
            continue
        print("model> ", end="", flush=True)
        try:
            turn = talk.reply(line, lambda piece: print(piece, end="", flush=True))
        except ConfigError as e:
            print(f"\n{e}", flush=True)
            continue
        except KeyboardInterrupt:
            print("\n(stopped)", flush=True)
            continue
        print(flush=True)
        if args.stats:
            print(f"[{turn.ran} prompt tokens run, {turn.reused} reused from the cache, {turn.generated} "
                  f"generated, {turn.generated / max(turn.seconds, 1e-9):.1f} tok/s]", flush=True)
