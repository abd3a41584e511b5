"""Tokenizers: HF ``tokenizers`` (a ``tokenizer.json``, the format Llama-3 ships) and a byte-level
fallback. Both expose the same small interface the dataset needs."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from shardwise.config import ConfigError

ASSETS = Path(__file__).parent / "assets"
SHIPPED_TOKENIZER = ASSETS / "tokenizer.json"
SHIPPED_CORPUS = ASSETS / "kjv.jsonl.gz"

# Special tokens recognised as begin/end of document, in order of preference.
_BOS = ("<|begin_of_text|>", "<|bos|>", "<s>", "[BOS]")
_EOS = ("<|end_of_text|>", "<|eos|>", "</s>", "<|endoftext|>", "[EOS]")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    fingerprint: str
    """Stable digest of the vocabulary and rules, used to key the token cache."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is begin-of-document, 257 end-of-document."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    fingerprint = "byte-v1"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a tokenizer.json with bos/eos special tokens."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ConfigError(f"data.tokenizer '{path}' is not a valid tokenizer.json: {e}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # The rows an embedding needs: ids may be sparse (a hand-made vocabulary), so the largest + 1.
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        bos = next((vocab[t] for t in _BOS if t in vocab), None)
        eos = next((vocab[t] for t in _EOS if t in vocab), None)
        if eos is None:
            raise ConfigError(f"data.tokenizer '{path}' has no end-of-document token (one of "
                              f"{', '.join(_EOS)}); add one as a special token")
        self.eos_id = eos
        self.bos_id = bos if bos is not None else eos
        self.fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str) -> Tokenizer:
    """'' -> the shipped BPE (vocab 2048, trained on the shipped corpus); 'byte' -> bytes; else a path."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser() if spec else SHIPPED_TOKENIZER
    if not path.is_file():
        raise ConfigError(f"data.tokenizer '{spec}' does not exist: give a tokenizer.json, 'byte', "
                          "or leave it empty for the shipped tokenizer")
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
