"""Hub ids (shardwise/runtime/hub.py): the cache read offline, a download from a local server that
answers as the Hub does (never the internet), the one-line errors, and who may fetch on a node.

Each case resolves in a fresh interpreter (no torch: about a second): ``huggingface_hub`` reads
HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE when it loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import ROOT, fake_hub, free_port, hub_cache

_RESOLVE = """
import json, sys
from shardwise.config.schema import ConfigError
from shardwise.runtime import hub
out = []
for call, ref in json.loads(sys.argv[1]):
    try:
        got = hub.download(ref)[1] if call == "download" else getattr(hub, call)(ref, "--hf")
        out.append(["ok", str(got)])
    except ConfigError as e:
        out.append(["error", str(e)])
print(json.dumps(out))
"""

def _resolve(home: Path, calls: list[tuple[str, str]], **env: str) -> list[list[str]]:
    """Each (hub function, ref) resolved in one fresh process: ["ok", path] or ["error", line]."""
    full = {**os.environ, "HF_HOME": str(home), "PYTHONPATH": str(ROOT), **env}
    for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "LOCAL_RANK", "HF_TOKEN"):
        if k not in env:
            full.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(calls)], env=full, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])

def _repo(tmp_path: Path) -> Path:
    """A model repository as the Hub holds one: what a run reads, and code and a pickle it must not."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True, exist_ok=True)
    for name, text in {"config.json": '{"model_type": "qwen3"}', "model.safetensors": "weights",
                       "tokenizer.json": '{"model": {}}', "tokenizer_config.json": "{}",
                       "modeling_x.py": "import os",
                       "pytorch_model.bin": "pickle", "README.md": "# card",
                       "data/train.jsonl": '{"text": "a"}\n'}.items():
        (repo / name).write_text(text)
    return repo

def test_a_hub_id_reads_a_prefilled_cache_offline_and_a_missing_one_names_the_fix(tmp_path: Path):
    home = tmp_path / "home"
    snapshot = hub_cache(home, "Qwen/Qwen3-0.6B", _repo(tmp_path))
    dataset = hub_cache(home, "org/corpus", _repo(tmp_path), kind="dataset")
    found = _resolve(home, [("local_model", "Qwen/Qwen3-0.6B"),
                            ("local_dataset", "hf://datasets/org/corpus/data"),
                            ("local_model", "Qwen/Qwen3-8B"), ("local_model", "Qwen/Qwen3-0.6B@v2")],
                     HF_HUB_OFFLINE="1")
    assert found[0] == ["ok", str(snapshot)]
    assert found[1] == ["ok", str(dataset / "data")]
    for kind, said in found[2:]:
        assert kind == "error" and "HF_HUB_OFFLINE is set" in said and "shardwise download Qwen/" in said
        assert str(home / "hub") in said and "\n" not in said
    # a path that exists is that path, whatever it looks like
    local = tmp_path / "Qwen" / "Qwen3-0.6B"
    local.mkdir(parents=True)
    os.chdir(tmp_path)
    try:
        assert _resolve(home, [("local_model", "Qwen/Qwen3-0.6B")], HF_HUB_OFFLINE="1") == [
            ["ok", "Qwen/Qwen3-0.6B"]]
    finally:
        os.chdir(ROOT)

def test_a_download_fetches_what_a_run_reads_and_says_how_each_failure_is_fixed(tmp_path: Path):
    repo = _repo(tmp_path)
    with fake_hub({"org/tiny": repo, "org/gated": repo, "datasets/org/corpus": repo},
                  gated=frozenset({"org/gated"})) as (url, served):
        found = _resolve(tmp_path / "home", [("local_model", "org/tiny"),
                                             ("local_dataset", "hf://datasets/org/corpus"),
                                             ("local_model", "org/gated"), ("local_model", "org/none"),
                                             ("download", "hf://datasets/org/corpus/typo")],
                         HF_ENDPOINT=url)
    assert found[4][0] == "error" and "no corpus files under 'typo'" in found[4][1]
    snapshot = Path(found[0][1])
    assert found[0][0] == "ok" and snapshot.is_relative_to(tmp_path / "home" / "hub")
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors",
                                                          "tokenizer.json", "tokenizer_config.json"]
    assert (snapshot / "config.json").read_text() == '{"model_type": "qwen3"}'
    assert not {"modeling_x.py", "pytorch_model.bin", "README.md"} & set(served)  # no code, no pickle
    assert found[1][0] == "ok"
    assert sorted(p.name for p in Path(found[1][1]).rglob("*.jsonl")) == ["train.jsonl"]
    assert found[2][0] == "error" and "gated" in found[2][1] and "`hf auth login`" in found[2][1]
    assert found[3][0] == "error" and "the Hub has no model 'org/none'" in found[3][1]
    # no network: the Hub cannot be reached (a closed port), and nothing is cached
    (kind, said), (dl, dl_said) = _resolve(tmp_path / "empty", [("local_model", "org/tiny"),
                                                                ("download", "org/tiny")],
                                           HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert kind == "error" and "the Hub cannot be reached" in said and "`shardwise download org/tiny`" in said
    assert dl == "error" and "run the download on a machine with network" in dl_said  # (not itself)

def test_a_launched_rank_reads_the_cache_only_and_a_torchrun_rank_waits_for_local_rank_0(tmp_path: Path):
    repo = _repo(tmp_path)
    with fake_hub({"org/tiny": repo}) as (url, served):
        kind, said = _resolve(tmp_path / "home", [("local_model", "org/tiny")], HF_ENDPOINT=url,
                              SHARDWISE_ERROR_DIR=str(tmp_path))[0]
        assert kind == "error" and "this rank reads the cache only" in said and served == []
        # LOCAL_RANK 1 polls the cache until local rank 0's copy is whole, never asking the Hub
        home = tmp_path / "home"
        filled = threading.Timer(1.5, lambda: hub_cache(home, "org/tiny", repo))
        filled.start()
        start = time.monotonic()
        kind, path = _resolve(home, [("local_model", "org/tiny")], HF_ENDPOINT=url, LOCAL_RANK="1")[0]
        filled.join()
        assert kind == "ok" and Path(path).parent.parent.name == "models--org--tiny" and served == []
        assert time.monotonic() - start > 1.5


def test_a_missing_revision_and_a_failing_hub_are_one_line_each(tmp_path: Path):
    """An unknown revision names it; a Hub that answers 503 (and a cache without the files) says so and
    to try later -- not that the Hub cannot be reached, not to download elsewhere."""
    repo = _repo(tmp_path)
    with fake_hub({"org/tiny": repo, "org/down": repo, "datasets/org/corpus": repo},
                  down=frozenset({"org/down"})) as (url, served):
        found = _resolve(tmp_path / "home", [("local_model", "org/tiny@v9"), ("local_model", "org/down"),
                                             ("download", "org/down"), ("download", "hf://datasets/org/corpus@v9")],
                         HF_ENDPOINT=url)
    assert found[0] == ["error", "--hf: the model org/tiny has no revision 'v9'"]
    for kind, said in found[1:3]:
        assert kind == "error" and "the Hub answered 503 for 'org/down'" in said and "try again later" in said
        assert str(tmp_path / "home" / "hub") in said  # the cache folder it looked in
        assert "cannot be reached" not in said and "\n" not in said
    assert found[3][0] == "error" and "has no revision 'v9'" in found[3][1]
    assert served == []


_LISTED = """
import json, sys
from pathlib import Path
from shardwise.runtime import hub
print(json.dumps(sorted(p.name for p in hub.local_model(sys.argv[1], "--hf").iterdir())))
"""


def test_a_waiting_rank_never_takes_a_half_written_snapshot(tmp_path: Path):
    """Local rank 0 fetches while the weights arrive 3 s late; local rank 1 starts once the snapshot
    holds the config but not the weights, and returns only the whole snapshot (huggingface_hub >= 1.22
    lists the files before fetching them and refuses a snapshot missing one)."""
    home, repo = tmp_path / "home", _repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "LOCAL_RANK"}
    env.update(HF_HOME=str(home), PYTHONPATH=str(ROOT))
    whole = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    with fake_hub({"org/tiny": repo}, slow={"model.safetensors": 3.0}) as (url, served):
        env["HF_ENDPOINT"] = url
        first = subprocess.Popen([sys.executable, "-c", _LISTED, "org/tiny"], env={**env, "LOCAL_RANK": "0"},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        snapshots, deadline = home / "hub" / "models--org--tiny" / "snapshots", time.monotonic() + 60
        while not any(snapshots.glob("*/config.json")):
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()
            time.sleep(0.02)
        assert not any(snapshots.glob("*/model.safetensors"))  # half-written: the weights are on their way
        second = subprocess.run([sys.executable, "-c", _LISTED, "org/tiny"], env={**env, "LOCAL_RANK": "1"},
                                capture_output=True, text=True, timeout=120)
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, err + second.stderr
    assert json.loads(out) == json.loads(second.stdout.splitlines()[-1]) == whole
    assert "waiting for local rank 0 to fetch org/tiny" in second.stdout + second.stderr
    assert sorted(served) == whole  # each file once: the waiting rank never asked the Hub


def test_a_huggingface_hub_without_the_snapshot_check_is_refused_in_one_line(tmp_path: Path):
    """Below 1.22 (pyproject's pin, bypassed by a --no-deps install) a rank could read a half-written
    snapshot: every Hub id is refused, naming the version and the fix -- by a rank that fetches, by
    one that would wait for local rank 0 (at once, not after the wait), and by ``download``."""
    script = ("from huggingface_hub import errors, snapshot_download\ndel errors.IncompleteSnapshotError\n"
              "from shardwise.config.schema import ConfigError\nfrom shardwise.runtime import hub\n"
              "for call in (lambda: hub.local_model('org/tiny', '--hf'), lambda: hub.download('org/tiny')):\n"
              "    try:\n        call()\n    except ConfigError as err:\n        print(err)")
    base = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    for local_rank in ("0", "1"):
        env = {**base, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
               "LOCAL_RANK": local_rank}
        said = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip().splitlines()
        assert [line.split(":")[0] for line in said] == ["--hf", "download"], said
        assert all("huggingface_hub " in line and line.endswith("pip install 'huggingface_hub>=1.22'")
                   for line in said), said
