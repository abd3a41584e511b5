"""Interchange with Hugging Face checkpoints (``config.json`` + safetensors): the Llama family
(``LlamaForCausalLM``), Qwen3 (``Qwen3ForCausalLM``: QK-norm) and Qwen3-MoE (``Qwen3MoeForCausalLM``).

- :func:`args_from_hf`: the model shape from an HF ``config.json`` -- no preset or model flags.
- :func:`hf_config`: the ``config.json`` of the HF class matching a shape.
- :func:`export_hf`: a shardwise checkpoint (any layout; DCP gathers the shards) -> a complete HF
  folder (weights in bf16 or fp32, written one safetensors shard at a time, config, generation
  config, and the run's tokenizer with its chat template) that ``from_pretrained`` loads.
- :func:`import_hf`: an HF folder -> a weights-only shardwise checkpoint, to start training from
  with ``--checkpoint.path`` (optimizer, schedule and data start fresh), tensors read one at a time.

Our attention uses Meta's interleaved RoPE pairs; HF's uses rotate-half, so the q/k projection rows
(and the QK-norm weights, which scale the same channels) are permuted on the way out and back on the
way in (an exact permutation: a round trip is lossless). HF stores each expert's three matrices
(``mlp.experts.<e>.{gate,up,down}_proj.weight``, out x in); ours are one (E, in, out) tensor each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardwise.checkpoint import ModelTensors, read_manifest, run_config, save_model_only
from shardwise.checkpoint.manifest import manifest_lora, manifest_model
from shardwise.config.outputs import umask
from shardwise.config.schema import ConfigError, ModelConfig, read_config
from shardwise.data.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
from shardwise.models import ModelArgs, model_args
from shardwise.models.hf_config import (  # (hf_family: re-exported for the tests)
    args_from_hf,
    check_hf_config,
    expert_names,
    from_rotate_half,
    hf_config,
    hf_family,  # noqa: F401
    hf_names,
    model_config_of,
    read_hf_config,
    rope_rows,
    to_rotate_half,
)
from shardwise.models.lora import is_adapter, merged
from shardwise.models.transformer import build_model
from shardwise.runtime.hub import local_model

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SHARD_BYTES = 5 << 30  # split safetensors files at this size, as HF's save_pretrained does
def to_hf_tensors(get: Callable[[str], torch.Tensor], args: ModelArgs
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every HF tensor, from ``get`` (our name -> our tensor), one at a time."""
    for ours, hf in hf_names(args).items():
        yield hf, rope_rows(ours, get(ours), args, to_rotate_half)
    for ours, hf_list in expert_names(args).items():
        w = get(ours)  # (E, in, out)
        for e, hf in enumerate(hf_list):
            yield hf, w[e].t()


def to_hf_state(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    return dict(to_hf_tensors(state.__getitem__, args))


def from_hf_tensors(get: Callable[[str], torch.Tensor], args: ModelArgs,
                    names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, full tensor) of each parameter in ``names`` (default: every one), from ``get``
    (HF name -> HF tensor), one at a time."""
    one, experts = hf_names(args), expert_names(args)
    for ours in [*one, *experts] if names is None else names:
        if ours in one:
            yield ours, rope_rows(ours, get(one[ours]), args, from_rotate_half)
        else:
            yield ours, torch.stack([get(hf).t() for hf in experts[ours]])


def run_tokenizer(checkpoint: Path) -> str:
    """The data.tokenizer of the run that wrote ``checkpoint`` (its run directory's config.toml);
    "" (the shipped one, the run default) outside a run directory."""
    path = run_config(checkpoint)
    return read_config(path).data.tokenizer if path else ""


def write_tokenizer(spec: str, out: Path) -> tuple[int, int] | None:
    """The tokenizer of data.tokenizer ``spec`` into HF folder ``out``: tokenizer.json, and its
    tokenizer_config.json (special tokens, chat template; ``tokenizer_class`` set to the fast
    tokenizer class when it names none, so ``AutoTokenizer`` reads the file as it is),
    special_tokens_map.json and chat_template.jinja where the source has them. Returns (bos, eos)
    ids; None for the byte tokenizer, which has no HF form."""
    if spec == "byte":
        return None
    tok = load_tokenizer(spec)  # (checks it, and finds its bos/eos as training did)
    path = local_model(spec, "data.tokenizer") if spec else SHIPPED_TOKENIZER  # (a Hub id: its snapshot)
    path = path / "tokenizer.json" if path.is_dir() else path
    shutil.copyfile(path, out / "tokenizer.json")
    config_path = path.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    for name in ("special_tokens_map.json", "chat_template.jinja"):
        if (path.parent / name).is_file():
            shutil.copyfile(path.parent / name, out / name)
    return tok.bos_id, tok.eos_id


def export_hf(checkpoint: Path, out: Path, dtype: str = "bf16", tokenizer: str | None = None,
              checksums: bool = True) -> list[Path]:
    """Write a complete HF folder at ``out`` from a shardwise checkpoint: ``config.json``, safetensors
    (sharded above 5 GiB), ``generation_config.json`` and the tokenizer (``tokenizer``: a
    data.tokenizer spec; None = the run's, from its config.toml). Each tensor is read from the
    checkpoint, converted and added to the shard being built, which is written when full (one tensor
    in fp32 plus one shard in memory, never the whole model). The checkpoint's files are checked
    against its manifest first (``checksums``: their SHA-256 too)."""
    from safetensors.torch import save_file

    manifest = read_manifest(checkpoint)
    args, lora = manifest_model(manifest, checkpoint), manifest_lora(manifest, checkpoint)
    config = hf_config(args, dtype)
    state = ModelTensors(checkpoint, checksums)
    get = state.__getitem__ if lora is None else merged(state.__getitem__, set(state.specs), lora.rank,
                                                        lora.alpha)  # (the adapters folded in)
    if config["model_type"] != "deepseek_v3" and any(
            k.endswith("router.expert_bias") and state[k].any() for k in state.specs):
        raise ConfigError("this checkpoint's experts are chosen with a routing bias (model.moe_balance="
                          "bias), which HF Qwen3-MoE does not have: its routing would differ")
    itemsize = _DTYPES[dtype].itemsize
    meta = build_model(args).state_dict()
    plan = [(n, t.numel() * itemsize) for n, t in to_hf_tensors(meta.__getitem__, args)]
    shard_of, shards, size = {}, 0, 0
    for name, nbytes in plan:  # sizes from the meta model: file names need the shard count first
        if size and size + nbytes > _SHARD_BYTES:
            shards, size = shards + 1, 0
        shard_of[name], size = shards, size + nbytes
    n = shards + 1
    files = [out / "model.safetensors"] if n == 1 else \
        [out / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(run_tokenizer(checkpoint) if tokenizer is None else tokenizer, out)
    if ids is not None:  # the ids the model was trained with, not the family's defaults
        config["bos_token_id"], config["eos_token_id"] = ids
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids[0], "eos_token_id": ids[1], "do_sample": False}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if n > 1:
        index = {"metadata": {"total_size": sum(b for _, b in plan)},
                 "weight_map": {name: files[i].name for name, i in shard_of.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    current, tensors = 0, {}
    for name, t in to_hf_tensors(get, args):
        if shard_of[name] != current:
            save_file(tensors, str(files[current]), metadata={"format": "pt"})
            current, tensors = shard_of[name], {}
        tensors[name] = t.detach().to(_DTYPES[dtype]).contiguous()
    save_file(tensors, str(files[current]), metadata={"format": "pt"})
    for f in files:  # safetensors writes its files owner-only; an HF folder is shared like the rest of it
        os.chmod(f, 0o644 & ~umask())
    return files


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block(config: dict, folder: Path) -> tuple[int, int] | None:
    """The (rows, columns) of a block-scaled fp8 folder's scale blocks (DeepSeek-V3's published
    weights: ``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``),
    None without a ``quantization_config``; any other quantization is refused in one line."""
    q = config.get("quantization_config")
    if q is None:
        return None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if (isinstance(q, dict) and q.get("quant_method") == "fp8" and isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        return block[0], block[1]
    what = f"quant_method={q.get('quant_method')!r}" if isinstance(q, dict) else repr(q)[:60]
    raise ConfigError(f"'{folder / 'config.json'}' has quantization_config {what}: only block-scaled fp8 "
                      "weights (quant_method 'fp8' with weight_block_size, as DeepSeek-V3 publishes them) "
                      "are read: give a folder of unquantized (bf16/fp32) weights")


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   name: str = "weight") -> torch.Tensor:
    """A block-scaled fp8 weight (R, C) as fp32: each (block) tile times its ``scale_inv`` entry
    (ceil(R / br), ceil(C / bc)); tiles at the right and bottom edges may be partial (DeepSeek-V3's
    576-row ``kv_a_proj_with_mqa``). One fp32 copy of the weight, scaled one row of tiles at a time."""
    br, bc = block
    rows, cols = weight.shape
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ConfigError(f"HF tensor '{name}_scale_inv' has shape {tuple(scale_inv.shape)}; a {rows} x "
                          f"{cols} weight in {br} x {bc} blocks needs {want}: the folder is damaged or not "
                          "block-scaled as its config.json says")
    out = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    for i in range(want[0]):
        out[i * br:(i + 1) * br] *= scale[i].repeat_interleave(bc)[:cols]  # (C,) this row of tiles
    return out


class HFFolder:
    """An HF model folder's ``config.json`` and its safetensors tensors, read one at a time; block-
    scaled fp8 weights are read dequantized (:func:`dequantize_fp8`)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.config = read_hf_config(folder)
        self.fp8_block = fp8_block(self.config, folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"'{folder}' has no .safetensors files (only safetensors weights are read)")
        self._where = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ConfigError(f"'{f}' is not a readable safetensors file ({e})") from None
            self._where.update({k: handle for k in handle.keys()})  # noqa: SIM118 (a safe_open handle)

    def __getitem__(self, name: str) -> torch.Tensor:
        """A tensor by its HF name; a per-expert matrix also from transformers 5's fused layout
        (``mlp.experts.gate_up_proj`` (E, 2h, d), ``mlp.experts.down_proj`` (E, d, h))."""
        if name in self._where:
            t = self._where[name].get_tensor(name)
            return self._dequantized(name, t) if t.dtype in FP8 else t
        if ".mlp.experts." in name:
            prefix, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            if proj == "down_proj":
                return self[f"{prefix}.down_proj"][e]
            gate_up = self[f"{prefix}.gate_up_proj"][e]  # (2h, d)
            half = gate_up.shape[0] // 2
            return gate_up[:half] if proj == "gate_proj" else gate_up[half:]
        raise ConfigError(f"the HF checkpoint has no tensor '{name}': is it a "
                          f"{self.config.get('model_type')} checkpoint of this shape?")

    def _dequantized(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        scale = f"{name}_scale_inv"
        if self.fp8_block is None or scale not in self._where:
            why = ("its config.json has no block-scaled fp8 quantization_config" if self.fp8_block is None
                   else f"the folder has no '{scale}'")
            raise ConfigError(f"HF tensor '{name}' is {str(weight.dtype).removeprefix('torch.')} but {why}: "
                              "its scales are needed to read it; give a folder of unquantized weights")
        return dequantize_fp8(weight, self._where[scale].get_tensor(scale), self.fp8_block, name)


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: Path, args: ModelArgs) -> None:
    """Fill this rank's parameters (any layout: FSDP, TP and EP shards, pipeline stages) from an HF
    folder of ``args``'s shape: each parameter's full tensor is read and converted, and the rank
    keeps its shard -- the split :func:`shardwise.models.transformer.init_weights` makes, one full tensor at a
    time. Buffers stay as init built them (the RoPE table, MoE token counts), but for DeepSeek-V3's
    routing bias, which its checkpoints carry."""
    hf = HFFolder(folder)
    check_hf_config(hf.config, args)
    carried = hf_names(args)
    params = {**{n: p for n, p in model.named_parameters() if not is_adapter(n)},  # (LoRA's: their init)
              **{n: b for n, b in model.named_buffers() if n in carried}}
    for name, full in from_hf_tensors(hf.__getitem__, args, params):
        p = params[name]
        if tuple(full.shape) != tuple(p.shape):
            raise ConfigError(f"HF tensor for '{name}' has shape {tuple(full.shape)}, this model needs "
                              f"{tuple(p.shape)}")
        local = p.to_local() if isinstance(p, DTensor) else p
        full = full.to(device=local.device, dtype=local.dtype)
        if isinstance(p, DTensor):  # every rank read the same tensor: each keeps its shard, no comm
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        local.copy_(full)


def available_memory() -> int | None:
    """Bytes this machine can still give a process (Linux's MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(need: int, folder: Path) -> None:
    """``convert --from-hf`` holds every fp32 weight before writing the checkpoint (DCP writes one
    process's tensors from one dict): a model larger than the memory left is refused in one line
    naming the streaming path, before anything is read."""
    have = available_memory()
    if have is not None and need > 0.9 * have:
        raise ConfigError(f"converting '{folder}' holds its {need / 2**30:,.1f} GiB of fp32 weights in "
                          f"memory, and this machine has {have / 2**30:,.1f} GiB available: start training "
                          f"from the folder with --checkpoint.initial_hf {folder} instead (each rank reads "
                          "its own parameters one tensor at a time and keeps its shard)")


def import_hf(folder: Path, out: Path, model_cfg: ModelConfig | None = None) -> tuple[Path, ModelConfig]:
    """Write a weights-only shardwise checkpoint (fp32) at ``out`` from an HF folder. The shape comes
    from its config.json, or from ``model_cfg``, which must agree with it. Returns the checkpoint and
    the ``[model]`` section it records."""
    hf = HFFolder(folder)
    if model_cfg is None:
        args = args_from_hf(hf.config)
        model_cfg = model_config_of(args)
    else:
        args = model_args(model_cfg)
        check_hf_config(hf.config, args)

    expected = build_model(args).state_dict()
    check_host_memory(sum(t.numel() * 4 for t in expected.values()), folder)
    ours = {}
    for name, t in from_hf_tensors(hf.__getitem__, args):
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ConfigError(f"HF tensor for '{name}' has shape {tuple(t.shape)}, this model needs "
                              f"{tuple(expected[name].shape)}")
        ours[name] = t.to(torch.float32).contiguous()
    for name in expected:  # buffers saved with the weights (MoE routing bias): no bias
        if name not in ours:
            ours[name] = torch.zeros(expected[name].shape, dtype=expected[name].dtype)
    save_model_only(out, ours, {"model": dataclasses.asdict(model_cfg), "source": str(folder)})
    return out, model_cfg
