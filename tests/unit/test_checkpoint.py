"""Checkpoint commit protocol, verification, retention and async saves, on one gloo rank."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from shardwise import checkpoint
from shardwise.checkpoint import Checkpointer, CheckpointError
from shardwise.config.schema import CheckpointConfig
from shardwise.models import ModelArgs
from shardwise.models.transformer import build_model, init_weights

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=32)


class Position:
    """Stands in for the data loader: the checkpoint only needs its state dict."""

    def __init__(self) -> None:
        self.state = {"epoch": 0, "position": 0, "num_sequences": 10}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


def trainer(seed: int = 0):
    model = build_model(ARGS, device="cpu")
    init_weights(model, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched, Position()


def step(model, opt, sched, loader) -> None:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    model(tokens).float().square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    loader.state["position"] += 1


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def saver(tmp_path: Path, **kw) -> Checkpointer:
    return Checkpointer(tmp_path / "ckpt", CheckpointConfig(**kw), {"model": {"name": "tiny"}})


def test_save_commits_a_manifest_of_every_file(tmp_path: Path, one_rank_group: None):
    model, opt, sched, loader = trainer()
    ck = saver(tmp_path)
    path = ck.save(3, model, opt, sched, loader)
    ck.close()
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    on_disk = {p.name for p in path.iterdir()} - {checkpoint.MANIFEST}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk and "rng-rank0.pt" in on_disk
    for name, rec in manifest["files"].items():
        assert rec["bytes"] == (path / name).stat().st_size
        assert rec["sha256"] == checkpoint.sha256(path / name)
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["model"] == {"name": "tiny"}
    assert checkpoint.list_checkpoints(tmp_path / "ckpt") == [(3, path)]
    assert not list((tmp_path / "ckpt").glob("*.tmp"))


@pytest.mark.parametrize("optimizer", ["torch", "bf16-states"])
def test_a_save_at_step_0_leaves_the_training_as_it_would_be(tmp_path: Path, one_rank_group: None,
                                                           optimizer: str):
    """Saving a fresh optimizer (checkpoint.save_initial) makes its states, which torch does with a
    zero-gradient step at lr 0; the run then trains exactly as one that never saved, and a run
    resumed from that checkpoint too (fails at 6bad523: torch's step was counted, so every later
    update had AdamW's bias correction of one step more)."""
    from shardwise.optim.adamw import LowPrecisionAdamW

    def run(save: bool, resume: bool = False) -> dict[str, torch.Tensor]:
        model, opt, sched, loader = trainer()
        if optimizer == "bf16-states":
            opt = LowPrecisionAdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        if save:
            ck = saver(tmp_path / f"{save}{resume}")
            path = ck.save(0, model, opt, sched, loader)
            ck.close()
            if resume:
                model, _, _, loader = trainer(seed=5)
                opt = (LowPrecisionAdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16)
                       if optimizer == "bf16-states" else torch.optim.AdamW(model.parameters(), lr=1e-2))
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
                assert checkpoint.load(path, model, opt, sched, loader) == 0
        torch.manual_seed(7)  # the same batches each run
        for _ in range(3):
            step(model, opt, sched, loader)
        return params(model)

    plain = run(save=False)
    for saved in (run(save=True), run(save=True, resume=True)):
        for k, v in plain.items():
            assert torch.equal(saved[k], v), k


def test_load_restores_model_optimizer_schedule_data_and_rng(tmp_path: Path, one_rank_group: None):
    model, opt, sched, loader = trainer()
    step(model, opt, sched, loader)
    ck = saver(tmp_path)
    torch.manual_seed(123)
    path = ck.save(1, model, opt, sched, loader)
    ck.close()
    want_params, want_state = params(model), copy.deepcopy(opt.state_dict())
    want_next = torch.rand(3)  # what the RNG draws after the save
    step(model, opt, sched, loader)  # move everything on
    other, opt2, sched2, loader2 = trainer(seed=5)
    assert checkpoint.load(path, other, opt2, sched2, loader2) == 1
    for k, v in params(other).items():
        assert torch.equal(v, want_params[k]), k
    for pid, st in want_state["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state_dict()["state"][pid][key], st[key]), (pid, key)
    assert sched2.last_epoch == 1 and loader2.state["position"] == 1
    assert torch.equal(torch.rand(3), want_next)


def test_a_run_that_groups_the_parameters_otherwise_resumes_each_ones_state(tmp_path: Path,
                                                                           one_rank_group: None):
    """The optimizer's state is read per parameter name: a checkpoint saved with two groups resumes
    into an optimizer with a third (model.moe_router_lr_scale's routers) and back, every moment
    restored, each group keeping this run's own learning rate."""
    def grouped(n: int):
        model, _, _, loader = trainer(seed=5)
        named = list(model.named_parameters())
        half = len(named) // 2
        cut = [named[:half], named[half:]] if n == 2 else [named[:3], named[3:7], named[7:]]
        opt = torch.optim.AdamW([{"params": [p for _, p in g], "lr": 1e-2 * (i + 1)}
                                 for i, g in enumerate(cut)])
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), loader

    for saved_groups, resumed_groups in ((2, 3), (3, 2)):
        model, opt, sched, loader = grouped(saved_groups)
        step(model, opt, sched, loader)
        ck = saver(tmp_path / f"{saved_groups}")
        path = ck.save(1, model, opt, sched, loader)
        ck.close()
        names = {id(p): n for n, p in model.named_parameters()}
        want = {names[id(p)]: st for p, st in opt.state.items()}
        other, opt2, sched2, loader2 = grouped(resumed_groups)
        assert checkpoint.load(path, other, opt2, sched2, loader2) == 1
        names2 = {id(p): n for n, p in other.named_parameters()}
        got = {names2[id(p)]: st for p, st in opt2.state.items()}
        assert set(got) == set(want)
        for name, st in want.items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[name][key], st[key]), (name, key)
        lrs = [1e-2 * (i + 1) for i in range(resumed_groups)]
        assert [g["lr"] for g in opt2.param_groups] == pytest.approx(lrs)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_save_is_unaffected_by_later_steps(tmp_path: Path, one_rank_group: None, mode: str):
    model, opt, sched, loader = trainer()
    ck = saver(tmp_path, async_mode=mode)
    snapshot = params(model)
    path = ck.save(7, model, opt, sched, loader)  # returns once the state is copied
    for _ in range(3):  # training goes on, in place, while the write runs
        step(model, opt, sched, loader)
    ck.wait()
    assert checkpoint.list_checkpoints(tmp_path / "ckpt") == [(7, path)]
    restored, *_ = trainer(seed=9)
    checkpoint.load_model_only(path, restored)
    changed = params(model)
    for k, v in params(restored).items():
        assert torch.equal(v, snapshot[k]), k
    assert any(not torch.equal(changed[k], snapshot[k]) for k in snapshot)
    ck.close()


def test_keep_latest_k_and_leftovers_are_swept(tmp_path: Path, one_rank_group: None, capsys):
    model, opt, sched, loader = trainer()
    folder = tmp_path / "ckpt"
    (folder / "step-99.tmp").mkdir(parents=True)  # an interrupted save
    (folder / "step-98").mkdir()  # a directory without a manifest (never committed)
    assert checkpoint.list_checkpoints(folder, warn=True) == []
    assert capsys.readouterr().err.count("not a complete checkpoint") == 2
    ck = saver(tmp_path, keep_latest_k=2)
    for s in (1, 2, 3, 4):
        ck.save(s, model, opt, sched, loader)
    ck.close()
    assert [s for s, _ in checkpoint.list_checkpoints(folder)] == [3, 4]
    assert not (folder / "step-99.tmp").exists() and not list(folder.glob("*.deleting"))


def test_verify_catches_truncation_tampering_and_missing_manifest(tmp_path: Path, one_rank_group: None):
    model, opt, sched, loader = trainer()
    ck = saver(tmp_path)
    path = ck.save(1, model, opt, sched, loader)
    ck.close()
    checkpoint.verify(path)
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=f"truncated or altered: {shard.name} has"):
        checkpoint.verify(path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))  # same size: only the checksum can tell
    checkpoint.verify(path, checksums=False)
    with pytest.raises(CheckpointError, match=f"corrupt: {shard.name} does not match its SHA-256"):
        checkpoint.verify(path)
    (path / checkpoint.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable manifest.json"):
        checkpoint.verify(path)
    os.remove(path / checkpoint.MANIFEST)
    with pytest.raises(CheckpointError, match="is incomplete"):
        checkpoint.verify(path)


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path: Path, one_rank_group: None):
    model, opt, sched, loader = trainer()
    ck = saver(tmp_path)
    path = ck.save(1, model, opt, sched, loader)
    ck.close()
    checkpoint.check_compatible(path, build_model(ARGS))
    wider = build_model(dataclasses.replace(ARGS, dim=64, n_heads=8, n_kv_heads=4))
    with pytest.raises(CheckpointError, match=r"'tok_embeddings.weight' has shape \(64, 32\) there but "
                                              r"\(64, 64\) in this model"):
        checkpoint.check_compatible(path, wider)
    deeper = build_model(dataclasses.replace(ARGS, n_layers=3))
    with pytest.raises(CheckpointError, match="has no parameter 'layers.2.attention_norm.weight'"):
        checkpoint.check_compatible(path, deeper)
    with pytest.raises(CheckpointError, match="has parameter 'layers.1.attention.wk.weight' that this "
                                              "model lacks"):
        checkpoint.check_compatible(path, build_model(dataclasses.replace(ARGS, n_layers=1)))


def test_retention_never_deletes_the_new_checkpoint_or_a_newer_one(tmp_path: Path, one_rank_group: None):
    """keep_latest_k counts back from the step just committed: when higher-numbered checkpoints are
    there (an old run's), the new one survives and so do they."""
    folder = tmp_path / "ckpt"
    found = [(s, folder / f"step-{s}") for s in (1, 2, 10, 90, 100)]
    assert checkpoint.retired(found, committed=10, keep=1) == [folder / "step-1", folder / "step-2"]
    assert checkpoint.retired(found, committed=10, keep=2) == [folder / "step-1"]
    assert checkpoint.retired(found, committed=1, keep=1) == []
    assert checkpoint.retired(found, committed=10, keep=0) == []
    model, opt, sched, loader = trainer()
    old = saver(tmp_path)
    for s in (90, 100):
        old.save(s, model, opt, sched, loader)
    old.close()
    ck = saver(tmp_path, keep_latest_k=1)
    for s in (1, 2):
        ck.save(s, model, opt, sched, loader)
    ck.close()
    assert [s for s, _ in checkpoint.list_checkpoints(folder)] == [2, 90, 100]


def test_a_second_save_of_a_step_keeps_the_first(tmp_path: Path, one_rank_group: None, capsys):
    model, opt, sched, loader = trainer()
    ck = saver(tmp_path)
    first = ck.save(3, model, opt, sched, loader)
    manifest = (first / checkpoint.MANIFEST).read_text()
    ck.save(3, model, opt, sched, loader)
    ck.close()
    aside = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-3.superseded-")]
    assert len(aside) == 1 and (aside[0] / checkpoint.MANIFEST).read_text() == manifest
    assert "already existed: kept as" in capsys.readouterr().err
    assert checkpoint.list_checkpoints(tmp_path / "ckpt") == [(3, first)]
    checkpoint.list_checkpoints(tmp_path / "ckpt", warn=True)
    assert "kept aside, never loaded or deleted" in capsys.readouterr().err


def test_rng_state_round_trips_as_plain_tensors(tmp_path: Path):
    import random

    import numpy as np

    torch.manual_seed(3), random.seed(4), np.random.seed(5)
    state = checkpoint.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))  # no pickled objects
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1] and np.random.rand() == want[2]


class _Payload:
    """Unpickling this runs a command: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _rehash(path: Path) -> None:
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"bytes": (path / name).stat().st_size,
                                   "sha256": checkpoint.sha256(path / name)}
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("where", ["rng", "metadata"])
def test_a_checkpoint_that_would_run_code_is_refused(where: str, tmp_path: Path, one_rank_group: None):
    """A shared checkpoint whose RNG file or DCP .metadata carries a pickled object that runs a command
    (checksums made to match) is refused with one line, and the command never runs."""
    import pickle

    model, opt, sched, loader = trainer()
    ck = saver(tmp_path)
    path = ck.save(1, model, opt, sched, loader)
    ck.close()
    marker = tmp_path / "pwned"
    if where == "rng":
        torch.save({"cpu": _Payload(marker)}, path / "rng-rank0.pt")
    else:
        (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rehash(path)
    checkpoint.verify(path)  # the files are "intact": only what they hold is wrong
    fresh = trainer(seed=1)
    with pytest.raises(CheckpointError, match="refused, since loading it could run code") as e:
        checkpoint.load(path, *fresh)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_a_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path, one_rank_group: None):
    """DCP reads each item from the file its .metadata names: a name like '../secret' (hashes made to
    match) would be read from outside the checkpoint folder; refused in one line."""
    from shardwise.checkpoint.reader import SafeReader, _MetadataUnpickler

    model, opt, sched, loader = trainer()
    ck = saver(tmp_path)
    path = ck.save(1, model, opt, sched, loader)
    ck.close()
    with (path / ".metadata").open("rb") as f:
        meta = _MetadataUnpickler(f).load()
    outside = tmp_path / "elsewhere.distcp"
    first = next(iter(meta.storage_data))
    shutil.copy(path / meta.storage_data[first].relative_path, outside)
    meta.storage_data[first].relative_path = "../elsewhere.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    _rehash(path)
    with pytest.raises(CheckpointError, match="points at '../elsewhere.distcp', outside the checkpoint"):
        SafeReader(str(path)).read_metadata()
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        checkpoint.load(path, *trainer(seed=1))


def test_changing_what_the_model_computes_is_refused(tmp_path: Path, one_rank_group: None):
    """Shapes alone do not tell a checkpoint's function: RoPE base and scaling, norm epsilon, routing
    do too. Each differing field is named with both values; training-only fields may differ."""
    from shardwise.resolve.checks import load_config

    model, opt, sched, loader = trainer()
    cfg = load_config(None, ["--model.name=moe-debug"])
    ck = Checkpointer(tmp_path / "ckpt", CheckpointConfig(), {"model": dataclasses.asdict(cfg.model)})
    path = ck.save(1, model, opt, sched, loader)
    ck.close()
    checkpoint.check_same_function(path, cfg.model)
    for field, value in (("rope_theta", 20000.0), ("rope_scaling_factor", 8.0), ("norm_eps", 1e-3),
                         ("head_size", 32), ("moe_score", "sigmoid"), ("moe_top_k", 1),
                         ("moe_balance", "bias"), ("moe_route_scale", 2.0), ("moe_route_norm", False)):
        other = load_config(None, ["--model.name=moe-debug", f"--model.{field}={value}"])
        saved = re.escape(repr(getattr(cfg.model, field)))
        with pytest.raises(CheckpointError, match=rf"model\.{field}={saved}, this run has "
                                                  rf"model\.{field}={re.escape(repr(value))}"):
            checkpoint.check_same_function(path, other.model)
    for field, value in (("moe_aux_coef", 0.5), ("max_seq_len", 4096), ("moe_balance", "none")):
        checkpoint.check_same_function(path, load_config(None, ["--model.name=moe-debug",
                                                                f"--model.{field}={value}"]).model)
