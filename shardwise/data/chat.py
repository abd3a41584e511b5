"""Conversations -> tokens and a loss mask, through a tokenizer's chat template.

A chat row is a list of messages ``{"role": ..., "content": ...}``. It is rendered with the
tokenizer's Jinja chat template (the ``chat_template`` of a Hugging Face ``tokenizer_config.json``, in
a sandbox, as ``transformers`` renders it) and tokenized once; the tokens that belong to an assistant
turn are the ones the loss counts. An assistant turn's span is what rendering it adds after the
generation prompt: from ``render(messages[:i], add_generation_prompt=True)`` to
``render(messages[:i + 1])`` -- its content and whatever closes the turn (the end-of-turn token the
model must learn to emit), never the role header the prompt already holds. That needs a template
under which earlier turns render the same when later ones follow (ChatML, Llama 3 and the shipped
one do); one that rewrites history is refused with one line.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from shardwise.config import ConfigError

Message = dict[str, str]


class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to."""

    def __init__(self, source: str, special: dict[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"the tokenizer's chat template does not compile: {e}") from None
        self.source, self.special = source, special

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special)

    def assistant_spans(self, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) character span of each assistant turn)."""
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            after = self.render(messages[:i + 1])
            if not (full.startswith(after) and after.startswith(before)):
                raise ValueError("the chat template renders an earlier turn differently once later turns "
                                 "follow, so an assistant turn's tokens cannot be found: use a template "
                                 "that keeps history as rendered (e.g. ChatML)")
            spans.append((len(before), len(after)))
        return full, spans


def check_messages(value: Any) -> str:
    """Why ``value`` is not a conversation (a list of role/content string pairs with an assistant
    turn), or ""."""
    if not isinstance(value, list) or not value:
        return f"a {type(value).__name__}, not a non-empty list of messages"
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return "a message that is not an object with string 'role' and 'content'"
    if not any(m["role"] == "assistant" for m in value):
        return "no assistant message (nothing to train on)"
    return ""


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in an assistant span, else 0."""
    out, k = [], 0
    for start, _ in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        out.append(int(k < len(spans) and spans[k][0] <= start))
    return out


@functools.cache
def _compiled(source: str, special: tuple[tuple[str, str], ...]) -> ChatTemplate:
    return ChatTemplate(source, dict(special))


def template(source: str, special: dict[str, str]) -> ChatTemplate:
    """A compiled template, built once per process (preparation workers render many rows)."""
    return _compiled(source, tuple(sorted(special.items())))
