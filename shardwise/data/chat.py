"""Conversations -> tokens and a loss mask, through a tokenizer's chat template.

A chat row is a list of messages ``{"role": ..., "content": ...}``. It is rendered with the
tokenizer's Jinja chat template (the ``chat_template`` of a Hugging Face ``tokenizer_config.json``, in
a sandbox, as ``transformers`` renders it) and tokenized once; the tokens that belong to an assistant
turn are the ones the loss counts, found in the rendered conversation in one of three ways:

- **Generation markers.** A template that wraps what the assistant writes in ``{% generation %}``
  ... ``{% endgeneration %}`` (Hugging Face's convention) says where each turn is: those spans.
- **Prefixes.** An assistant turn's span is what rendering it adds after the generation prompt: from
  ``render(messages[:i], add_generation_prompt=True)`` to ``render(messages[:i + 1])`` -- its content
  and whatever closes the turn (the end-of-turn token the model must learn to emit), never the role
  header the prompt already holds. That holds for templates under which earlier turns render the same
  when later ones follow (ChatML, Llama 3, the shipped one).
- **A probe,** for a template that rewrites history (Qwen3's drops the reasoning of assistant turns
  before the last user turn): the turn's content is swapped for a marker the template cannot alter
  and the conversation rendered again; the two renderings agree everywhere but where the turn's
  content went, which locates it as the full conversation renders it. The span runs from the end of
  the generation prompt to the end of the turn's closing (what follows its content when the turn ends
  the conversation). A template that leaves an assistant turn out altogether is refused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import signal
import threading
from collections.abc import Iterator
from typing import Any

from shardwise.config.schema import ConfigError

Message = dict[str, str]


RENDER_LIMIT_S = 10.0
"""The longest one conversation's rendering may take (a template is code from the model's folder: a
loop that never ends, or one nested to billions of steps, stops here instead of hanging prepare)."""


class TemplateRaised(ValueError):
    """The chat template failed on one conversation (it raised, or ran past :data:`RENDER_LIMIT_S`):
    a problem of that row, which ``data.skip_bad_rows`` skips and counts."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TemplateRaised` in the block after ``seconds`` (an interval timer: the main
    thread of a process only -- elsewhere the block runs without a limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(*_: Any) -> None:
        raise TemplateRaised(f"the chat template took more than {seconds:g} s to render this conversation")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


OPEN, CLOSE = "\ue000", "\ue001"
"""Private-use characters that mark a ``{% generation %}`` block's output."""
_MARKED = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _generation_tag() -> type:
    """The ``{% generation %}`` ... ``{% endgeneration %}`` block: its output, between markers."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return OPEN + caller() + CLOSE

    return GenerationTag


class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to."""

    def __init__(self, source: str, special: dict[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_tag()])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"the tokenizer's chat template does not compile: {e}") from None
        self.source, self.special = source, special
        self.marked = bool(_MARKED.search(source))

    def _render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        """The rendering with any generation markers left in; :class:`TemplateRaised` if the
        template raises (its ``raise_exception``, or an error in its code) or runs too long."""
        try:
            with _time_limit(RENDER_LIMIT_S):
                return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **self.special)
        except TemplateRaised:
            raise
        except Exception as e:  # noqa: BLE001 - the template's own code failed: one line, per row
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise TemplateRaised(f"the chat template raised {type(e).__name__}: {first}") from None

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self._render(messages, add_generation_prompt).replace(OPEN, "").replace(CLOSE, "")

    def assistant_spans(self, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) character span of each assistant turn)."""
        if self.marked:
            return _marked_spans(self._render(messages))
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            after = self.render(messages[:i + 1])
            if full.startswith(after) and after.startswith(before):
                spans.append((len(before), len(after)))
            else:
                spans.append(self._probed_span(messages, i, full, before))
        return full, spans

    def _probed_span(self, messages: list[Message], i: int, full: str, before: str) -> tuple[int, int]:
        """Assistant turn ``i``'s span in ``full`` where the template renders history differently
        from the prefixes (the module's docstring)."""
        probe = "\ue002turn\ue003"  # (not the generation markers, which rendering removes)
        swapped = [*messages[:i], {**messages[i], "content": probe}, *messages[i + 1:]]
        other = self.render(swapped)
        if probe not in other:
            raise ValueError(f"the chat template leaves assistant turn {i + 1} of {len(messages)} messages "
                             "out of the rendered conversation, so its tokens cannot be trained: use a "
                             "template that renders every assistant turn (or marks them with "
                             "{% generation %})")
        start = 0
        while start < min(len(full), len(other)) and full[start] == other[start]:
            start += 1
        tail = 0
        while tail < min(len(full), len(other)) - start and full[-1 - tail] == other[-1 - tail]:
            tail += 1
        end = len(full) - tail  # the end of the turn's content as the conversation renders it
        last = self.render(swapped[:i + 1])
        closing = last[last.index(probe) + len(probe):]  # what ends the turn (its end-of-turn token)
        if not full.startswith(before) or len(before) > start or not full.startswith(closing, end):
            raise ValueError(f"the chat template renders assistant turn {i + 1} so that its tokens cannot "
                             "be found (its generation prompt or closing moves): mark what the assistant "
                             "writes with {% generation %} ... {% endgeneration %}")
        return len(before), end + len(closing)


def _marked_spans(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Text with generation markers -> (the text without them, the spans they enclosed)."""
    out, spans, start = [], [], None
    length = 0
    for piece in re.split(f"([{OPEN}{CLOSE}])", text):
        if piece == OPEN:
            start = length
        elif piece == CLOSE:
            if start is not None and length > start:
                spans.append((start, length))
            start = None
        else:
            out.append(piece)
            length += len(piece)
    return "".join(out), spans


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
