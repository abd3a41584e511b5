"""Tokenizers: HF ``tokenizers`` (a ``tokenizer.json``, the format Llama-3 ships) and a byte-level
fallback. Both expose the same small interface the dataset needs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

from shardwise.config.schema import ConfigError
from shardwise.data.chat import ChatTemplate, Message, TemplateRaised, template, token_mask
from shardwise.runtime.hub import local_model

Rendered = tuple[str, list[tuple[int, int]]]
"""A conversation as its chat template renders it, and each assistant turn's [start, end) characters."""

ASSETS = Path(__file__).parent / "assets"
SHIPPED_TOKENIZER = ASSETS / "tokenizer.json"
SHIPPED_CORPUS = ASSETS / "kjv.jsonl.gz"
SHIPPED_CHAT = ASSETS / "kjv_chat.jsonl.gz"  # conversations made from it (scripts/make_chat.py)

# Special tokens recognised as begin/end of document, in order of preference.
_BOS = ("<|begin_of_text|>", "<|bos|>", "<s>", "[BOS]")
_EOS = ("<|end_of_text|>", "<|eos|>", "</s>", "<|endoftext|>", "[EOS]")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    fingerprint: str
    """Stable digest of the vocabulary and rules, used to key the token cache."""
    chat: ChatTemplate | None
    """The chat template (data.format=chat), when the tokenizer has one."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_chats(self, chats: list[list[Message]]) -> list[tuple[list[int], list[int]]]: ...

    def render_chat(self, chat: list[Message]) -> Rendered: ...

    def encode_rendered(self, rendered: list[Rendered]) -> list[tuple[list[int], list[int]]]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt to continue, with the special tokens the tokenizer itself adds (generation)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is begin-of-document, 257 end-of-document."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    fingerprint = "byte-v1"
    chat = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_chats(self, chats: list[list[Message]]) -> list[tuple[list[int], list[int]]]:
        return self.encode_rendered([self.render_chat(c) for c in chats])

    def render_chat(self, chat: list[Message]) -> Rendered:
        raise ConfigError("data.format=chat needs a tokenizer with a chat template; 'byte' has none")

    def encode_rendered(self, rendered: list[Rendered]) -> list[tuple[list[int], list[int]]]:
        raise ConfigError("data.format=chat needs a tokenizer with a chat template; 'byte' has none")

    def encode_prompt(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template (a string, or named templates: "default"), else the
    folder's chat_template.jinja (how newer Hugging Face folders store it)."""
    t = config.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if isinstance(t, str):
        return t
    jinja = folder / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json, with the special tokens and chat template of
    the ``tokenizer_config.json`` beside it when there is one (a Hugging Face tokenizer folder);
    without it, bos/eos are found by name."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ConfigError(f"data.tokenizer '{path}' is not a valid tokenizer.json: {e}") from None
        config: dict[str, Any] = {}
        config_path = path.parent / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise ConfigError(f"'{config_path}' is not valid JSON ({e})") from None
            if not isinstance(config, dict):
                raise ConfigError(f"'{config_path}' holds a JSON {type(config).__name__}, not an object of "
                                  "tokenizer settings: replace it with the model's own tokenizer_config.json")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # The rows an embedding needs: ids may be sparse (a hand-made vocabulary), so the largest + 1.
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        named = {k: _token_text(config.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
        for k, text in named.items():
            if text is not None and text not in vocab:
                raise ConfigError(f"'{config_path}' names {k}_token {text!r}, which '{path}' does not have")
        bos = vocab[named["bos"]] if named["bos"] else next((vocab[t] for t in _BOS if t in vocab), None)
        eos = vocab[named["eos"]] if named["eos"] else next((vocab[t] for t in _EOS if t in vocab), None)
        if eos is None:
            raise ConfigError(f"data.tokenizer '{path}' has no end-of-document token (one of "
                              f"{', '.join(_EOS)}, or eos_token in tokenizer_config.json); add one")
        self.eos_id = eos
        self.bos_id = bos if bos is not None else eos
        self.pad_id = vocab[named["pad"]] if named["pad"] else self.eos_id
        source = _chat_template(path.parent, config) if config_path.is_file() else None
        special = {f"{k}_token": v for k, v in named.items() if v is not None}
        self.chat = template(source, special) if source else None
        digest = hashlib.sha256(path.read_bytes())
        digest.update(json.dumps([self.bos_id, self.eos_id, source], sort_keys=True).encode())
        self.fingerprint = digest.hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_chats(self, chats: list[list[Message]]) -> list[tuple[list[int], list[int]]]:
        """Each conversation rendered by the chat template and tokenized: (ids, 1 on assistant tokens).
        The template writes the special tokens itself (no bos/eos is added)."""
        return self.encode_rendered([self.render_chat(c) for c in chats])

    def render_chat(self, chat: list[Message]) -> Rendered:
        """The conversation as the chat template renders it, with each assistant turn's character
        span; :class:`TemplateRaised` when the template fails on this conversation (a bad row)."""
        if self.chat is None:
            raise ConfigError("data.format=chat needs a chat template: data.tokenizer's folder has no "
                              "chat_template in tokenizer_config.json (nor a chat_template.jinja)")
        try:
            return self.chat.assistant_spans(chat)
        except TemplateRaised:
            raise
        except ValueError as e:
            raise ConfigError(f"data.format=chat: {e}") from None

    def encode_rendered(self, rendered: list[Rendered]) -> list[tuple[list[int], list[int]]]:
        """Rendered conversations (:meth:`render_chat`) tokenized: (ids, 1 on assistant tokens)."""
        encoded = self._tok.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        return [(e.ids, token_mask(e.offsets, spans))
                for e, (_, spans) in zip(encoded, rendered, strict=True)]

    def encode_prompt(self, text: str) -> list[int]:
        """``text`` as ``transformers``' tokenizer call encodes it: with the special tokens the
        tokenizer's post-processor adds (Llama 3's begin-of-text; none for Qwen3)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str) -> Tokenizer:
    """'' -> the shipped BPE (vocab 2048, trained on the shipped corpus, with a chat template);
    'byte' -> bytes; else a tokenizer.json, a Hugging Face tokenizer folder holding one, or a Hub model
    id whose repository does (runtime/hub.py)."""
    if spec == "byte":
        return ByteTokenizer()
    path = local_model(spec, "data.tokenizer") if spec else SHIPPED_TOKENIZER
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"data.tokenizer '{spec}' does not exist: give a tokenizer.json, a folder with "
                          "one, 'byte', or leave it empty for the shipped tokenizer")
    return HFTokenizer(path)


def train_bpe(texts: list[str], vocab_size: int, out: Path) -> None:
    """Train a byte-level BPE tokenizer.json with <|bos|>, <|eos|> and <|pad|> special tokens."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out))
