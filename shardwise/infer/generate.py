"""``shardwise generate``: text from a trained model -- a shardwise checkpoint (or a run directory:
its latest one) or a Hugging Face folder -- with greedy or sampled decoding and a KV cache.

The prompt is plain text (tokenized as the tokenizer's own post-processor does, begin-of-text
included where it adds one, as ``transformers``' tokenizer call does) or a conversation rendered by
the tokenizer's chat template with the generation prompt. Decoding stops at ``--max-new-tokens`` or
at an end token: the tokenizer's end-of-document token and the ``eos_token_id`` of a folder's
``generation_config.json`` (an instruct model's end-of-turn token among them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import read_manifest
from shardwise.checkpoint.hf import load_hf_weights, run_tokenizer
from shardwise.checkpoint.manifest import checkpoint_or_latest, manifest_lora, manifest_model
from shardwise.checkpoint.peft import load_adapter
from shardwise.checkpoint.reader import check_compatible, load_model_only
from shardwise.config.schema import ConfigError, LoRAConfig
from shardwise.data.chat import check_messages
from shardwise.data.tokenizer import load_tokenizer
from shardwise.models.hf_config import args_from_hf, peft_lora_config, read_hf_config
from shardwise.models.lora import apply_lora, fold_lora
from shardwise.models.transformer import KVCache, build_model, rope_table
from shardwise.ops.cpu_bf16 import use_fp32_gemms_for_bf16
from shardwise.runtime.hub import local_model
from shardwise.runtime.machine import device_type


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy with ``temperature`` 0, else sampled from the softmax
    at that temperature over the ``top_k`` most likely tokens (0: all) whose probabilities sum to
    ``top_p`` (the nucleus; 1: all)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> the chosen ids (B,)."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)  # (B, V)
        probs = sorted_logits.softmax(-1)
        # drop a token when the more likely ones already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= s.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def generate(model: torch.nn.Module, prompt: list[int], s: Sampling, stop: set[int],
             use_cache: bool = True) -> list[int]:
    """The tokens ``model`` adds after ``prompt``: up to ``s.max_new_tokens``, ending with the first
    id in ``stop`` if one comes. ``use_cache``: each step runs the new token only, against the
    cached keys and values (else the whole sequence again: the reference the cache is tested on)."""
    with torch.no_grad():
        return _decode(model, prompt, s, stop, use_cache)


def _decode(model: torch.nn.Module, prompt: list[int], s: Sampling, stop: set[int], use_cache: bool
            ) -> list[int]:
    device = next(model.parameters()).device
    limit = model.args.max_seq_len
    if len(prompt) + s.max_new_tokens > limit:
        raise ConfigError(f"the prompt ({len(prompt)} tokens) plus --max-new-tokens {s.max_new_tokens} "
                          f"exceeds the model's context of {limit} tokens: shorten the prompt or lower "
                          "--max-new-tokens")
    generator = sampler(s, device)
    if use_cache:
        cache = KVCache(len(prompt) + s.max_new_tokens)
        return list(continue_tokens(model, cache, prompt, s, stop, generator))
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, S)
    out: list[int] = []
    for _ in range(s.max_new_tokens):
        nxt = next_token(model(tokens)[:, -1], s, generator)  # (1,)
        out.append(int(nxt))
        if out[-1] in stop:
            break
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return out


def sampler(s: Sampling, device: torch.device) -> torch.Generator | None:
    """The seeded generator sampling draws from (None: greedy)."""
    return torch.Generator(device=device).manual_seed(s.seed) if s.temperature > 0 else None


@torch.no_grad()
def continue_tokens(model: torch.nn.Module, cache: KVCache, new: list[int], s: Sampling, stop: set[int],
                    generator: torch.Generator | None) -> Iterator[int]:
    """Run ``new`` after the tokens ``cache`` holds, then yield up to ``s.max_new_tokens`` chosen
    tokens as they come, ending with the first id in ``stop``. Each token but the last is run
    through the model (into the cache) before the next is chosen."""
    device = next(model.parameters()).device
    step_input = torch.tensor([new], dtype=torch.long, device=device)  # (1, S)
    for i in range(s.max_new_tokens):
        logits = model(step_input, cache=cache)  # (1, S, V)
        nxt = next_token(logits[:, -1], s, generator)  # (1,)
        yield int(nxt)
        if int(nxt) in stop or i == s.max_new_tokens - 1:
            return
        step_input = nxt[:, None]  # (1, 1)


# ---------------------------------------------------------------------------------------------
# Loading a model and its tokenizer

@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: Any
    stop: set[int]
    source: str


def _materialized(args: Any, device: torch.device, lora: LoRAConfig | None = None) -> torch.nn.Module:
    """The model on ``device`` (fp32) with its buffers set and its parameters still to be loaded
    (``lora``: with the adapters a checkpoint holds)."""
    model = build_model(args)
    if lora is not None:
        apply_lora(model, lora)
    model = model.to_empty(device=device)
    for name, b in model.named_buffers():
        if name != "rope":
            b.zero_()  # MoE routing state: a loaded checkpoint overwrites the persistent ones
    model.rope = rope_table(args, device=device)
    return model.eval()


def load_for_generation(checkpoint: str = "", hf: str = "", tokenizer: str = "", device: str = "auto",
         dtype: str = "auto", checksums: bool = True, adapter: str = "") -> Loaded:
    """The model of a checkpoint (or run directory) or HF folder (``adapter``: with a PEFT LoRA
    folder's adapters folded in), with its tokenizer and end ids; a checkpoint's files are checked
    against its manifest first (``checksums``: SHA-256 too)."""
    dev = torch.device(device_type(device))
    dt = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
          "fp32": torch.float32}[dtype]
    stop: set[int] = set()
    if hf:
        folder = local_model(hf, "--hf")  # (a Hub id: its snapshot in the cache)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"--hf '{hf}' is not a Hugging Face model folder (no config.json)")
        if not tokenizer and not (folder / "tokenizer.json").is_file():  # (before reading any weights)
            raise ConfigError(f"--hf '{hf}' has no tokenizer.json: pass --tokenizer with the model's "
                              "tokenizer folder")
        spec = tokenizer or str(folder)
        args = args_from_hf(read_hf_config(folder))
        lora = LoRAConfig(**peft_lora_config(Path(adapter), args, "--adapter")) if adapter else None
        model = _materialized(args, dev, lora)
        load_hf_weights(model, folder, args)  # (the base: the adapters are the folder's)
        if lora is not None:
            load_adapter(model, Path(adapter), args)
            fold_lora(model)
        model = model.to(dt)
        stop |= generation_eos(folder)
        source = str(folder)
    else:
        if adapter:
            raise ConfigError("--adapter puts a PEFT adapter on an HF model (--hf); a LoRA checkpoint holds "
                              "its own adapters: drop --adapter")
        path = Path(checkpoint)
        if not path.exists():
            raise ConfigError(f"--checkpoint '{checkpoint}' does not exist")
        path = checkpoint_or_latest(path)
        manifest = read_manifest(path)
        args, lora = manifest_model(manifest, path), manifest_lora(manifest, path)
        model = _materialized(args, torch.device("cpu"), lora)
        check_compatible(path, model)
        load_model_only(path, model, checksums)
        fold_lora(model)  # (a LoRA run's adapters into its weights: the model its export computes)
        model = model.to(device=dev, dtype=dt)
        spec = tokenizer or run_tokenizer(path)
        source = str(path)
    model.rope = model.rope.float()  # (the rotation runs in fp32 whatever the weights' dtype)
    use_fp32_gemms_for_bf16(dev.type, "bf16" if dt == torch.bfloat16 else "fp32")
    tok = load_tokenizer(spec)
    if tok.vocab_size > model.args.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the model {model.args.vocab_size}: "
                          "pass the --tokenizer the model was trained with")
    return Loaded(model, tok, stop | {tok.eos_id}, source)


def generation_eos(folder: Path) -> set[int]:
    """The end ids of a folder's generation_config.json (one id or a list), if it has one."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def prompt_ids(tok: Any, prompt: str = "", messages: list[dict[str, str]] | None = None) -> list[int]:
    """Token ids of a text prompt or of a conversation rendered for the assistant's next turn."""
    if messages is not None:
        if tok.chat is None:
            raise ConfigError("--messages needs a tokenizer with a chat template; this one has none")
        return tok.encode_batch([tok.chat.render(messages, add_generation_prompt=True)])[0]
    ids = tok.encode_prompt(prompt)
    if not ids:
        raise ConfigError("--prompt is empty: give some text (or --messages)")
    return ids


# ---------------------------------------------------------------------------------------------
# The command (its flags: shardwise/commands/generate.py)

def from_flags(args: argparse.Namespace, extra: list[str]) -> tuple[Sampling, Loaded]:
    """The sampling and the loaded model that generate's and chat's shared flags name
    (commands/generate.py add_model_source, add_sampling); checked before the model loads."""
    if extra:
        raise ConfigError(f"{args.command} takes no config overrides: {' '.join(extra)}")
    s = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    s.check()
    return s, load_for_generation(args.checkpoint or "", args.hf or "", args.tokenizer, args.device,
                                  args.dtype, checksums=not args.skip_checksums, adapter=args.adapter)


def generate_command(args: argparse.Namespace, extra: list[str]) -> int:
    messages = None
    if args.messages:
        path = Path(args.messages)
        try:
            messages = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--messages '{path}' is not a readable JSON file ({e})") from None
        # (the conversation so far: the check wants an assistant turn, the one to generate)
        turn = {"role": "assistant", "content": ""}
        bad = check_messages([*messages, turn]) if isinstance(messages, list) else "not a list of messages"
        if bad:
            raise ConfigError(f"--messages '{path}': {bad}")
    s, loaded = from_flags(args, extra)
    ids = prompt_ids(loaded.tokenizer, args.prompt or "", messages)
    out = generate(loaded.model, ids, s, loaded.stop, use_cache=not args.no_cache)
    text = loaded.tokenizer.decode(out)
    if args.json:
        print(json.dumps({"source": loaded.source, "prompt_tokens": ids, "tokens": out, "text": text}))
    else:
        print(text)
    return 0
