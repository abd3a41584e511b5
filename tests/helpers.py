"""What the tests share: the tiny run's flags and its runner, the CLI in a subprocess, the parity
measures, a tiny model, a free port, checkpoint damage, a chat tokenizer folder. Tests import from
here (and from tests/references.py), never from one another (tests/unit/test_structure.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.data.tokenizer import ASSETS
from shardwise.models import ModelArgs, model_args
from shardwise.models.transformer import (
    build_model,
    init_weights,
)
from shardwise.parallel.dims import DEGREES, MESH_DIMS
from shardwise.plan.comm import group_members
from shardwise.resolve.checks import load_config, resolve_config
from shardwise.resolve.layouts import fill_layouts
from shardwise.resolve.run import ResolvedRun, resolve_run
from shardwise.verify.parity import checkpoint_params, update_error

ROOT = Path(__file__).resolve().parents[1]


# A tiny GQA Llama on the shipped corpus: fp32, deterministic, document masking on (so the number
# of valid labels differs between sequences, which is what the global-token normalization handles).
TINY_ARGS = [
    "--config", str(ROOT / "configs" / "debug.toml"),
    # A tiny Llama (the preset's recipe adds QK-norm; the references these tests hold it to are HF Llama)
    "--model.qk_norm=false",
    "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.multiple_of=16", "--training.seq_len=64", "--training.global_batch=8",
    "--training.steps=10", "--training.mixed_precision=fp32", "--lr_scheduler.warmup_steps=2",
    "--debug.deterministic=true", "--data.document_mask=true", "--eval.interval=0",
    "--checkpoint.interval=0", "--checkpoint.final=false", "--metrics.tensorboard=false",
    "--metrics.plot=false", "--metrics.log_format=line", "--metrics.peak_tflops=1",
    # Eager even when a test runs 100,000 steps to be stopped by a signal (compile.enabled=auto
    # would compile those): compile has its own tests, which pass --compile.enabled=true.
    "--compile.enabled=false",
]


# .ci/run sets this: there a missing test tool (transformers, wandb, chromium, unshare) is a failure;
# elsewhere the test that needs it is skipped with its reason shown (pytest -rs).
IN_CI = os.environ.get("SHARDWISE_CI") == "1"


def need(what: str, present: bool) -> None:
    """Fail under CI, skip visibly elsewhere, when ``what`` (a tool a test needs) is not ``present``."""
    if present:
        return
    if IN_CI:
        pytest.fail(f"{what} is missing: .ci/run must install it")
    pytest.skip(f"{what} is not available on this machine")


def require(module: str):  # noqa: ANN201 - the module
    """Import a test dependency, under :func:`need`'s rule."""
    import importlib
    import importlib.util

    need(f"python package {module}", importlib.util.find_spec(module) is not None)
    return importlib.import_module(module)


def run_cli(args: list[str], timeout: float = 300, launcher: list[str] | None = None,
            check: bool = True, fault: str = "", cwd: Path = ROOT,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m shardwise <args>`` (or under ``launcher``, e.g. torchrun), from ``cwd``, with ``env``
    added to the test's environment.
    ``fault``: break one thing on purpose in every process of the run (tests/faults/sitecustomize.py).
    A plain command is forked from the tests' CLI server (tests/cli_server.py), which has imported
    torch and the trainer once; a launcher, a fault or a changed environment get a fresh interpreter."""
    cmd = [sys.executable, *(launcher or ["-m", "shardwise"]), *args]
    env = {**cli_env(), **(env or {})}
    if fault:
        env["SHARDWISE_TEST_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "faults"),
                                                          env.get("PYTHONPATH")]))
    if launcher is None and not fault:
        proc = _forked(cmd, env, cwd, timeout)
    else:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def cli_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test's command runs in: the test's own (or ``base``), unbuffered, not a
    launched rank, with this interpreter's scripts (``shardwise``, ``torchrun``) on the PATH."""
    env = {**(os.environ if base is None else base), "PYTHONUNBUFFERED": "1"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("WORLD_SIZE", None)
    return env


class _CliServer:
    """The running tests/cli_server.py: one command at a time (the suite runs serially)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_server.py")], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b""
        self.answer(None)  # ready

    def answer(self, deadline: float | None) -> dict | None:
        """The server's next line, or None at ``deadline`` (time.monotonic)."""
        import select
        import time

        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the tests' CLI server died (exit {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:
        import signal
        import time

        with tempfile.TemporaryDirectory() as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
            request = {"argv": cmd[3:], "env": env, "cwd": str(cwd), "stdout": out, "stderr": err}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = self.answer(None)["pid"]
            done = self.answer(time.monotonic() + timeout)
            if done is None:  # as subprocess.run does: kill it, then say so
                os.kill(pid, signal.SIGKILL)
                self.answer(None)
                raise subprocess.TimeoutExpired(cmd, timeout, Path(out).read_text(), Path(err).read_text())
            return subprocess.CompletedProcess(cmd, done["status"], Path(out).read_text(errors="replace"),
                                               Path(err).read_text(errors="replace"))


def _but_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what no library reads when it loads: PATH, and the test's name (pytest sets it)."""
    return {k: v for k, v in env.items() if k not in ("PATH", "PYTEST_CURRENT_TEST")}


_server: _CliServer | None = None
_SESSION_ENV = dict(os.environ)  # the session's environment, before any test changes it


def _forked(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` (``python -m shardwise ...``) forked from the CLI server, when the server's environment
    is the command's (:func:`_but_path`); a fresh interpreter otherwise."""
    global _server
    base = cli_env(_SESSION_ENV)
    if _but_path(env) != _but_path(base):
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if _server is None or _server.proc.poll() is not None:
        _server = _CliServer(base)
    return _server.run(cmd, env, cwd, timeout)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def resolved_config(path: str | Path | None, overrides: list[str] | None = None,
                    device: str | None = None):  # noqa: ANN201 - a Config
    """The config as a run on ``device`` resolves it (None: this machine): what the planner plans from."""
    return resolve_config(load_config(path, overrides), device)


def planned(cfg, world: int) -> ResolvedRun:  # noqa: ANN001 - a Config
    """``cfg`` on ``world`` ranks resolved as the planner resolves a candidate (no device detection)."""
    return resolve_run(cfg, world, detect_device=False)


@contextlib.contextmanager
def one_rank_pg() -> Iterator[None]:
    """A one-rank gloo process group for the block (the one already there, if any)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'pg')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


TINY_MODEL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16,
                 max_seq_len=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layouts(table: dict[str, list[str]], slow: set[str]) -> list:
    """Parametrize over ``table``'s layouts, marking the extended ones ``slow``."""
    return [pytest.param(k, marks=pytest.mark.slow) if k in slow else k for k in table]


def train_tiny(run_dir: Path, cache: str, *extra: str, launcher: list[str] | None = None, fault: str = "",
               check: bool = True) -> subprocess.CompletedProcess:
    """``shardwise train`` on :data:`TINY_ARGS` (then ``extra``) into ``run_dir``, with the session's
    token cache: the one runner of the tests' tiny runs."""
    return run_cli(["train", *TINY_ARGS, f"--data.cache_dir={cache}", f"--run.dir={run_dir}", *extra],
                   launcher=launcher, check=check, fault=fault)


def parity_run(tmp: Path, name: str, cache: str, *extra: str, launcher: list[str] | None = None,
               fault: str = "") -> Path:
    """A tiny run into ``tmp/name`` that saves its final checkpoint (for :func:`param_error`)."""
    train_tiny(tmp / name, cache, "--checkpoint.final=true", *extra, launcher=launcher, fault=fault)
    return tmp / name


def initial_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights the run started from: init is layout-independent, so rebuild it on one CPU."""
    cfg = load_config(run_dir / "config.toml")
    model = build_model(model_args(cfg.model), device="cpu")
    init_weights(model, cfg.training.seed)
    return model.state_dict()


def param_error(ref_dir: Path, run_dir: Path) -> float:
    """max over tensors of ||p_run - p_ref|| / ||p_ref - p_init|| (verify's measure)."""
    final = lambda d: checkpoint_params(d / "checkpoints" / "step-10")  # noqa: E731
    return update_error(final(run_dir), final(ref_dir), initial_params(ref_dir))


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


LOSS_RTOL = 1e-5
"""Parity in fp32: per-step loss and grad norm, relative."""
PARAM_RTOL = 1e-4
"""Parity in fp32: final parameters, as a fraction of how far training moved them."""


def asked_layout(asked: list[str]) -> tuple[int, dict[str, int]]:
    """The world size and the degrees a run's ``--nproc=N --parallel.X=D`` arguments ask for
    (``dp_shard``: the ranks the others leave). Worked out here, not by the resolver: a resolver that
    dropped a flag must not also decide what the check expects."""
    world, degrees = 1, {str(d): 1 for d in DEGREES}
    given: set[str] = set()
    for arg in asked:
        key, _, value = arg.removeprefix("--").partition("=")
        key = key.removeprefix("parallel.")
        if key == "nproc":
            world = int(value)
        elif key in degrees:
            degrees[key] = int(value)
            given.add(key)
    if "dp_shard" not in given:
        others = degrees["pp"] * degrees["dp_replicate"] * degrees["cp"] * degrees["tp"]
        degrees["dp_shard"] = world // others
    return world, degrees


def check_layout_ran(run_dir: Path, asked: list[str], layout: str, step: int = 10) -> None:
    """The run in ``run_dir`` ran the layout ``asked`` names, read from what torch recorded of it (not
    from the config the run resolved): its final checkpoint has one DCP file and one RNG file per rank
    of that world; the mesh the manifest records (``DeviceMesh`` sizes) has each dim of that size;
    DCP's chunks of each parameter tile it as FSDP over dp_shard x cp (x tp under TP, the attention's
    output projection split along its input dim; routed experts over dp_shard x cp x tp) implies, within
    one pipeline stage's ranks, every stage holding parameters; and each rank's parameter bytes (the
    run's own count of its local shards, memory_breakdown.json) are one chunk of each of its stage's
    parameters. ``step``: the final checkpoint's."""
    from torch.distributed.checkpoint import FileSystemReader

    world, deg = asked_layout(asked)
    ckpt = run_dir / "checkpoints" / f"step-{step}"
    names = {p.name for p in ckpt.iterdir()}
    assert {n for n in names if n.endswith(".distcp")} == {f"__{r}_0.distcp" for r in range(world)}, \
        f"{layout}: DCP files {sorted(n for n in names if n.endswith('.distcp'))} for {world} ranks"
    assert {n for n in names if n.startswith("rng-rank")} == {f"rng-rank{r}.pt" for r in range(world)}, layout
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == world, (layout, manifest["world_size"], world)
    built = {d: manifest["mesh"][d] for d in map(str, MESH_DIMS)}
    assert built == {d: deg[d] for d in map(str, MESH_DIMS)}, f"{layout}: mesh built {built}, asked {deg}"
    moe_shard = deg["dp_shard"] * deg["cp"] * deg["tp"]
    if deg["ep"] > 1:
        assert manifest["mesh"]["ep"] == deg["ep"], (layout, manifest["mesh"])
        assert manifest["mesh"]["experts"] == deg["dp_replicate"] * moe_shard // deg["ep"], layout
    else:
        assert "ep" not in manifest["mesh"], (layout, manifest["mesh"])
    meta = FileSystemReader(str(ckpt)).read_metadata()
    states = meta.state_dict_metadata
    params = sorted(k.removeprefix("optimizer.state.").removesuffix(".exp_avg") for k in states
                    if k.startswith("optimizer.state.") and k.endswith(".exp_avg"))
    holders: dict[str, set[int]] = {}
    for index, info in meta.storage_data.items():
        rank = int(info.relative_path.removeprefix("__").split("_")[0])
        holders.setdefault(index.fqn, set()).add(rank)
    stage_ranks, fsdp = world // deg["pp"], deg["dp_shard"] * deg["cp"]
    held: dict[int, tuple[int, int]] = {}  # stage -> (bytes of the smallest chunks, of the largest)
    for name in params:
        md = states[f"model.{name}"]
        chunks = [c for c in md.chunks if c.sizes.numel()]
        numels = [c.sizes.numel() for c in chunks]
        assert sum(numels) == md.size.numel() and len({tuple(c.offsets) for c in chunks}) == len(chunks), \
            f"{layout}: {name}'s chunks do not tile it"
        want = {moe_shard} if ".experts." in name else {fsdp, fsdp * deg["tp"]}
        assert len(chunks) in want, f"{layout}: {name} in {len(chunks)} chunks, the layout implies {want}"
        if deg["tp"] > 1 and name.endswith("attention.wo.weight"):
            splits = len({c.offsets[1] for c in chunks})
            assert splits == deg["tp"], f"{layout}: {name} split {splits} ways along its input dim"
        stages = {r // stage_ranks for r in holders[f"model.{name}"]}
        assert len(stages) == 1, f"{layout}: {name} is held by the ranks of stages {sorted(stages)}"
        (stage,), size = stages, md.properties.dtype.itemsize
        lo, hi = held.get(stage, (0, 0))
        held[stage] = (lo + min(numels) * size, hi + max(numels) * size)
    assert sorted(held) == list(range(deg["pp"])), f"{layout}: parameters on stages {sorted(held)}"
    per_rank = json.loads((run_dir / "memory_breakdown.json").read_text())["params_per_rank"]
    assert len(per_rank) == world, layout
    for rank, gib in enumerate(per_rank):
        lo, hi = held[rank // stage_ranks]
        assert lo - 1 <= round(gib * 2**30) <= hi + 1, f"{layout}: rank {rank} holds {gib * 2**30:.0f} " \
            f"parameter bytes, one chunk of each of its stage's parameters is {lo}-{hi}"


def check_same_run(reference: Path, run_dir: Path, layout: str, asked: list[str]) -> None:
    """``run_dir`` trained the run ``reference`` (one rank) did -- per-step loss, grad norm and
    held-out loss, final parameters -- and each ran the layout it was asked for (``asked``: the run's
    ``--nproc`` and ``--parallel.*`` arguments; :func:`check_layout_ran`)."""
    check_layout_ran(reference, [], "the one-rank reference")
    check_layout_ran(run_dir, asked, layout)
    ref, got = metrics(reference), metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, 11))
    loss_diff = max_rel([r["loss"] for r in got], [r["loss"] for r in ref])
    norm_diff = max_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
    assert loss_diff <= LOSS_RTOL, f"{layout}: loss max rel diff {loss_diff:.2e}"
    assert norm_diff <= LOSS_RTOL, f"{layout}: grad-norm max rel diff {norm_diff:.2e}"
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.2  # the run actually trains
    vals = [r["val_loss"] for r in ref if "val_loss" in r]  # held-out loss, where the run evaluates
    assert [r["val_loss"] for r in got if "val_loss" in r] == pytest.approx(vals, rel=LOSS_RTOL), layout
    # The parameters after 10 steps (not just losses) are the same.
    err = param_error(reference, run_dir)
    assert err <= PARAM_RTOL, f"{layout}: final params differ by {err:.2e} of the update"


def truncate_shard(ckpt: Path) -> None:
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])


def flip_byte(ckpt: Path) -> None:
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x55
    shard.write_bytes(bytes(data))


# Qwen3's behaviour: an assistant turn's reasoning (before </think>) is kept only after the last user
# turn; earlier turns keep their answer alone.
QWEN3 = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
         "{% for m in messages %}{% if m['role'] == 'assistant' %}"
         "{% set parts = m['content'].split('</think>') %}"
         "{% set answer = parts[-1].lstrip('\n') %}"
         "{% set thought = parts[0].replace('<think>', '').strip('\n') if parts | length > 1 else '' %}"
         "<|im_start|>assistant\n{% if loop.index0 > ns.last %}<think>\n{{ thought }}\n</think>\n\n"
         "{% endif %}{{ answer }}<|im_end|>\n"
         "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


SPECIAL = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<think>", "</think>"]
"""The chat templates' special tokens (one token each in :func:`chat_folder`'s tokenizer)."""


def chat_folder(tmp_path: Path, template: str) -> Path:
    """The shipped tokenizer with the templates' special tokens (one token each) and ``template``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    tok.add_special_tokens(SPECIAL)
    folder = tmp_path / "tok"
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((ASSETS / "tokenizer_config.json").read_text())
    config.update(chat_template=template, tokenizer_class="PreTrainedTokenizerFast")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tiny_qwen3(tmp_path: Path) -> Path:
    """A tiny Qwen3 folder as the Hub holds one: transformers' weights and config (seed 0) and a chat
    tokenizer (:func:`chat_folder` with Qwen3's template)."""
    transformers = require("transformers")
    tok_dir = chat_folder(tmp_path, QWEN3)
    hf_cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      vocab_size=2112, max_position_embeddings=256, tie_word_embeddings=True)
    base = tmp_path / "base"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(hf_cfg).save_pretrained(base)
    for f in tok_dir.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    return base


def hub_cache(hf_home: Path, repo: str, folder: Path, kind: str = "model") -> Path:
    """``folder``'s files laid out as the Hugging Face cache under ``hf_home`` holds repository
    ``repo`` at revision main: content-addressed blobs, a snapshot of links to them, refs/main. Returns
    the snapshot folder."""
    import hashlib

    root = hf_home / "hub" / f"{kind}s--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


@contextlib.contextmanager
def fake_hub(repos: dict[str, Path], gated: frozenset[str] = frozenset(), down: frozenset[str] = frozenset(),
             missing: frozenset[str] = frozenset(), slow: dict[str, float] | None = None,
             ) -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server answering ``huggingface_hub``'s download requests (repository info, file
    tree, file metadata and bytes) for ``repos`` ({"ORG/NAME" or "datasets/ORG/NAME": folder}) at
    revision ``main`` (or its commit), with the Hub's error codes for an unknown repository, an unknown
    revision, a ``gated`` one, and 503 for every request about one that is ``down``; a ``missing`` file
    (``ORG/NAME/PATH``) is listed but answers 404 (a download that fails half-way); ``slow``: a file's
    bytes are sent that many seconds late ({path in the repository: seconds}). Yields (its URL, for
    HF_ENDPOINT; the paths of the files whose bytes were sent, in order)."""
    import hashlib
    import http.server
    import re
    import threading

    served: list[str] = []
    files = {name: {str(f.relative_to(d)): f for f in sorted(d.rglob("*")) if f.is_file()}
             for name, d in repos.items()}

    def commit(name: str) -> str:
        return hashlib.sha1(name.encode()).hexdigest()

    class Hub(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def answer(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def route(self) -> None:
            path = self.path.split("?")[0]
            api = re.match(r"^/api/(models|datasets)/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?$", path)
            raw = re.match(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if api:
                name = ("datasets/" if api[1] == "datasets" else "") + api[2]
            elif raw:
                name = (raw[1] or "") + raw[2]
            else:
                return self.answer(404, b"{}")
            if name not in repos:
                return self.answer(404, b'{"error": "Repository not found"}',
                                   {"X-Error-Code": "RepoNotFound", "X-Error-Message": "no such repository"})
            if name in down:
                return self.answer(503, b'{"error": "Service Unavailable"}')
            if name in gated:
                return self.answer(401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo",
                                   "X-Error-Message": f"Access to {name} is restricted"})
            sha, have = commit(name), files[name]
            if (api[4] if api else raw[3]) not in ("main", sha):
                return self.answer(404, b'{"error": "Invalid rev id"}',
                                   {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"})
            if api and api[3] == "revision":
                info = {"id": api[2], "sha": sha, "private": False,
                        "siblings": [{"rfilename": f} for f in have]}
                return self.answer(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
            if api:
                tree = [{"type": "file", "path": f, "size": p.stat().st_size,
                         "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for f, p in have.items()]
                return self.answer(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
            if raw[4] not in have:
                return self.answer(404, b"{}", {"X-Error-Code": "EntryNotFound"})
            if f"{name}/{raw[4]}" in missing:
                return self.answer(404, b"{}", {"X-Error-Code": "EntryNotFound"})
            body = have[raw[4]].read_bytes()
            if self.command == "GET":
                time.sleep((slow or {}).get(raw[4], 0.0))
                served.append(raw[4])
            self.answer(200, body, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(body).hexdigest()}"'})

        do_GET = do_HEAD = route

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------
# The fp32 parity matrix: every layout against one rank (tests/distributed/test_parity.py), each
# also localized against one rank (tests/e2e/test_localize.py)

LAYOUTS = {
    "fsdp2": ["--nproc=2", "--parallel.dp_shard=2"],
    "fsdp4": ["--nproc=4", "--parallel.dp_shard=4"],
    "hsdp2x2": ["--nproc=4", "--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
    "fsdp2_accum2": ["--nproc=2", "--training.micro_batch=2"],  # 2 micro-batches per rank
    "tp2": ["--nproc=2", "--parallel.tp=2"],
    "fsdp2_tp2": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2"],
    "hsdp2_tp2": ["--nproc=4", "--parallel.dp_replicate=2", "--parallel.tp=2", "--training.micro_batch=2"],
    "tp2_gathered_logits": ["--nproc=2", "--parallel.tp=2", "--parallel.loss_parallel=false"],
    # Fused chunked projection + loss (uneven chunks of 100 of the 256 tokens per micro-batch).
    "fsdp2_chunked_loss": ["--nproc=2", "--training.loss_chunk=100"],
    # Vocab-parallel chunked loss (vocab 2048 split over tp) with sequence parallel and FSDP.
    "fsdp2_tp2_chunked_loss": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2",
                               "--training.loss_chunk=100"],
    # Activation checkpointing recomputes exactly (fp32, deterministic): the same run.
    "fsdp2_ac_selective": ["--nproc=2", "--activation_checkpoint.mode=selective"],
    "tp2_ac_full": ["--nproc=2", "--parallel.tp=2", "--activation_checkpoint.mode=full"],
    # The half policy counts matmuls in forward and again in the recompute: under TP's DTensor ops
    # and sequence-parallel collectives both counts must agree.
    "tp2_ac_selective_half": ["--nproc=2", "--parallel.tp=2", "--activation_checkpoint.mode=selective_half"],
    "fsdp2_tp2_ac_layer": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2",
                           "--activation_checkpoint.mode=layer", "--activation_checkpoint.every=2"],
    "fsdp2_gloo_override": ["--nproc=2",
                            "--parallel.backend_override=dp_shard=gloo:timeout_s=120:threads=2,tp=gloo"],
    # Context parallel with document masks: each rank's queries (head-tail chunks, or one chunk
    # without load balance) against the gathered keys of their documents.
    "cp2_docs": ["--nproc=2", "--parallel.cp=2"],
    "cp2_docs_no_load_balance": ["--nproc=2", "--parallel.cp=2", "--parallel.cp_load_balance=false"],
    "cp4_docs": ["--nproc=4", "--parallel.cp=4"],
    "fsdp2_cp2_docs": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.cp=2"],
    "cp2_tp2_docs": ["--nproc=4", "--parallel.cp=2", "--parallel.tp=2"],
    "pp2_cp2_docs": ["--nproc=4", "--parallel.pp=2", "--parallel.cp=2", "--training.micro_batch=4"],
    # Pipeline stages each mask their own attention: the document ids travel with every micro-batch.
    "pp2_fsdp2_tp2": ["--nproc=8", "--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2",
                      "--training.micro_batch=2"],
    "pp2_1f1b": ["--nproc=2", "--parallel.pp=2", "--training.micro_batch=2"],
    "pp2_gpipe": ["--nproc=2", "--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--training.micro_batch=4"],
    "pp2_fsdp2": ["--nproc=4", "--parallel.pp=2", "--parallel.dp_shard=2", "--training.micro_batch=2"],
    "pp2_tp2": ["--nproc=4", "--parallel.pp=2", "--parallel.tp=2", "--training.micro_batch=2"],
}

# Context parallel without document masks runs torch's ring attention: against an unmasked reference.
UNMASKED_LAYOUTS = {
    "cp2": ["--nproc=2", "--parallel.cp=2"],
    "cp2_no_load_balance_alltoall": ["--nproc=2", "--parallel.cp=2", "--parallel.cp_load_balance=false",
                                     "--parallel.cp_rotate_method=alltoall"],
    "cp4": ["--nproc=4", "--parallel.cp=4"],
    "fsdp2_cp2": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.cp=2"],
    "hsdp2_cp2": ["--nproc=4", "--parallel.dp_replicate=2", "--parallel.cp=2"],
    "cp2_tp2": ["--nproc=4", "--parallel.cp=2", "--parallel.tp=2"],
    "cp2_ac_selective": ["--nproc=2", "--parallel.cp=2", "--activation_checkpoint.mode=selective"],
    "pp2_cp2": ["--nproc=4", "--parallel.pp=2", "--parallel.cp=2", "--training.micro_batch=4"],
}

# MoE (tiny moe-debug: 4 experts of width 32, top-2, a shared expert, block 0 dense), unmasked.
MOE_ARGS = ["--data.document_mask=false", "--model.name=moe-debug", "--model.dim=64", "--model.n_layers=2",
            "--model.n_heads=4", "--model.n_kv_heads=2", "--model.moe_hidden_dim=32", "--model.n_experts=4"]

MOE_LAYOUTS = {
    "moe_fsdp2": ["--nproc=2"],
    "moe_ep2": ["--nproc=2", "--parallel.ep=2"],
    "moe_fsdp4_ep2": ["--nproc=4", "--parallel.ep=2"],
    "moe_tp2": ["--nproc=2", "--parallel.tp=2"],
    "moe_ep2_tp2": ["--nproc=4", "--parallel.ep=2", "--parallel.tp=2"],
    "moe_ep4_tp2": ["--nproc=4", "--parallel.ep=4", "--parallel.tp=2"],
    "moe_cp2_ep2": ["--nproc=2", "--parallel.cp=2", "--parallel.ep=2"],
    "moe_hsdp2_ep2": ["--nproc=4", "--parallel.dp_replicate=2", "--parallel.ep=2"],
    "moe_pp2_ep2": ["--nproc=4", "--parallel.pp=2", "--parallel.ep=2", "--training.micro_batch=2"],
    # Recompute must not count the routed tokens twice (expert_load is compared too).
    "moe_ep2_ac_full": ["--nproc=2", "--parallel.ep=2", "--activation_checkpoint.mode=full"],
    "moe_ep2_ac_selective_half": ["--nproc=2", "--parallel.ep=2",
                                  "--activation_checkpoint.mode=selective_half"],
    "moe_cp2_ep2_chunked_loss": ["--nproc=2", "--parallel.cp=2", "--parallel.ep=2",
                                 "--training.loss_chunk=50"],
}

# DeepSeek-V3 (tiny deepseek-debug): latent attention with low-rank queries (rank 24), a 16-wide
# latent, heads of 8 no-RoPE + 4 RoPE channels and values 6 wide; 4 experts in 2 groups (top-2 from
# the best group), sigmoid routing balanced by bias, a shared expert, block 0 dense. Unmasked.
DEEPSEEK_ARGS = ["--data.document_mask=false", "--model.name=deepseek-debug", "--model.dim=64",
                 "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=4", "--model.q_lora_rank=24",
                 "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=4",
                 "--model.v_head_dim=6", "--model.moe_hidden_dim=32", "--model.n_experts=4",
                 "--model.moe_n_groups=2", "--model.moe_topk_groups=1", "--model.moe_bias_rate=0.01"]

DEEPSEEK_LAYOUTS = {
    "ds_fsdp2": ["--nproc=2"],
    "ds_tp2": ["--nproc=2", "--parallel.tp=2"],
    "ds_fsdp2_tp2": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2"],
    "ds_cp2": ["--nproc=2", "--parallel.cp=2"],
    "ds_ep2": ["--nproc=2", "--parallel.ep=2"],
    "ds_pp2": ["--nproc=2", "--parallel.pp=2", "--training.micro_batch=2"],
    # (an MoE block's sequence group under tp is shared by the pipeline stage's copy, not copied)
    "ds_pp2_tp2": ["--nproc=4", "--parallel.pp=2", "--parallel.tp=2", "--training.micro_batch=2"],
    # expert parallel x FSDP x tensor parallel
    "ds_ep2_fsdp2_tp2": ["--nproc=4", "--parallel.ep=2", "--parallel.tp=2"],
    "ds_cp2_tp2_full_q": ["--nproc=4", "--parallel.cp=2", "--parallel.tp=2", "--model.q_lora_rank=0"],
}

# Qwen3's attention: QK-norm (a per-head RMSNorm that tensor parallel runs on each rank's heads, its
# weight's gradient summed over tp), head width 32 at dim 64, an FFN width Llama's rule cannot give.
QWEN3_ARGS = ["--model.qk_norm=true", "--model.head_size=32", "--model.ffn_hidden_size=96"]

QWEN3_LAYOUTS = {
    "qwen3_tp2": ["--nproc=2", "--parallel.tp=2"],
    "qwen3_fsdp2_tp2": ["--nproc=4", "--parallel.dp_shard=2", "--parallel.tp=2"],
    "qwen3_fsdp2": ["--nproc=2", "--parallel.dp_shard=2"],
}

# ... and under the parallelisms that take no document mask, against an unmasked reference.
QWEN3_UNMASKED_LAYOUTS = {
    "qwen3_cp2": ["--nproc=2", "--parallel.cp=2"],
    "qwen3_pp2": ["--nproc=2", "--parallel.pp=2", "--training.micro_batch=2"],
}

# Schedules with 2 stages of one block per rank (looped or V-shaped): a 4-block model, its own
# reference, 4 micro-batches of 2 sequences; evaluated at steps 5 and 10 (the V-shaped schedules'
# eval runs a forward-only order of their own: parallel/pipeline.py Pipe._forward_only_order).
MULTI_STAGE = ["--data.document_mask=false", "--model.n_layers=4", "--training.micro_batch=2",
               "--eval.interval=5"]

MULTI_STAGE_LAYOUTS = {
    "pp2_interleaved": ["--nproc=2", "--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b"],
    "pp2_interleaved_fsdp2": ["--nproc=4", "--parallel.pp=2", "--parallel.dp_shard=2",
                              "--parallel.pp_schedule=interleaved1f1b"],
    "pp2_interleaved_tp2": ["--nproc=4", "--parallel.pp=2", "--parallel.tp=2",
                            "--parallel.pp_schedule=interleaved1f1b"],
    "pp2_zbv": ["--nproc=2", "--parallel.pp=2", "--parallel.pp_schedule=zbv"],
    "pp2_zbv_fsdp2": ["--nproc=4", "--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.pp_schedule=zbv"],
    "pp2_dualpipev": ["--nproc=2", "--parallel.pp=2", "--parallel.pp_schedule=dualpipev"],
    "pp2_dualpipev_tp2": ["--nproc=4", "--parallel.pp=2", "--parallel.tp=2",
                          "--parallel.pp_schedule=dualpipev"],
}


def as_verify_layout(args: list[str]) -> str | None:
    """A parity layout's arguments as a ``verify --layouts`` item (``--nproc=4 --parallel.tp=2`` ->
    ``tp=2,dp_shard=2``: verify's own fill); None when a value cannot be written there (it holds ','
    or '=')."""
    nproc, items = 1, []
    for arg in args:
        key, _, value = arg.removeprefix("--").partition("=")
        if key == "nproc":
            nproc = int(value)
        elif "," in value or "=" in value:
            return None
        else:
            degree = key.removeprefix("parallel.")
            items.append(f"{degree if degree in DEGREES else key}={value}")
    return fill_layouts([",".join(items)], nproc)[0]


def by_ranks(degrees, per_dim: dict[str, dict[str, int]]) -> dict:  # noqa: ANN001 - plan Degrees
    """Collective bytes keyed by (ranks of the group, collective): mesh dims that are one group merge
    (``--debug.comm``'s totals and the planner's, which name some groups by other dims)."""
    out: dict = {}
    for dim, per in per_dim.items():
        key = tuple(sorted(group_members(degrees, {"experts": "efsdp"}.get(dim, dim))))
        for kind, b in per.items():
            out[(key, kind)] = out.get((key, kind), 0) + b
    return out
