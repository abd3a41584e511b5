"""What the commands read and write where a user keeps files (issue #59, items 2 and 3).

- Every command that reads a checkpoint checks its files' sizes and SHA-256 against the manifest
  first (``--skip-checksums``: sizes only); a damaged file is one line naming it.
- Every command that writes a path the user names stages it beside the target and renames it in:
  a non-empty target is refused unless ``--overwrite``, a failure leaves nothing behind, and no
  path the command did not create is deleted (a ``<out>.tmp`` sibling, a user's hf export).
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from shardwise import checkpoint
from shardwise.cli import main
from shardwise.config.outputs import RunRecord
from shardwise.trainer.session import export_hf_folder
from tests.helpers import fake_hub, flip_byte, run_cli, train_tiny, truncate_shard

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    """A finished 4-step run with checkpoints step-2 and step-4 (tests copy what they change)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    train_tiny(run_dir, data_cache, "--training.steps=4", "--checkpoint.interval=2",
               "--checkpoint.final=true")
    return run_dir


def ckpt_copy(saved: Path, tmp_path: Path, step: int = 4) -> Path:
    out = tmp_path / f"step-{step}"
    shutil.copytree(saved / "checkpoints" / f"step-{step}", out)
    shutil.copy(saved / "config.toml", tmp_path / "config.toml")  # (the run's tokenizer, for generate)
    return out


def one_line(code: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("warning:", "notice:"))]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("shardwise: error:"), (code, err[-3000:])
    return lines[0]


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("command", ["generate", "convert", "verify_reader"])
def test_every_checkpoint_reader_checks_the_files(command: str, damage: str, saved: Path, tmp_path: Path,
                                                  capsys):
    """A same-size bit flip in a .distcp was generated from and exported with exit 0; a truncated one
    was a 58-line traceback. Now each is one line naming the file, and nothing is written."""
    ckpt = ckpt_copy(saved, tmp_path)
    (flip_byte if damage == "flip" else truncate_shard)(ckpt)
    before = files_under(tmp_path)
    want = "does not match its SHA-256" if damage == "flip" else "is truncated or altered"
    if command == "verify_reader":
        from shardwise.verify.parity import checkpoint_params

        with pytest.raises(checkpoint.CheckpointError, match=want):
            checkpoint_params(ckpt)
        return
    args = (["generate", "--checkpoint", str(ckpt), "--prompt", "the", "--max-new-tokens", "2"]
            if command == "generate" else ["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")])
    line = one_line(main(args), capsys.readouterr().err)
    assert want in line and ".distcp" in line, line
    assert files_under(tmp_path) == before and not (tmp_path / "hf").exists()
    if damage == "flip":  # sizes only, as asked: the flipped byte goes unnoticed (the flag's cost)
        assert main([*args, "--skip-checksums"]) == 0


def test_a_manifest_from_a_newer_version_is_one_line(saved: Path, tmp_path: Path, capsys):
    ckpt = ckpt_copy(saved, tmp_path)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest["model"]["attention_sinks"] = 4
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    for args in (["generate", "--checkpoint", str(ckpt), "--prompt", "a"],
                 ["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]):
        line = one_line(main(args), capsys.readouterr().err)
        said = "model field(s) attention_sinks in its manifest.json that this shardwise does not know"
        assert said in line, line


def test_convert_to_hf_never_mixes_two_models(saved: Path, tmp_path: Path, capsys):
    """--out naming a folder that holds files: refused and untouched; with --overwrite, replaced
    whole (the old index and shards do not stay beside the new ones)."""
    out = tmp_path / "my-model"
    out.mkdir()
    mine = {"config.json": b'{"mine": 1}', "tokenizer.json": b"{}", "model-00001-of-00002.safetensors": b"x"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    ckpt = saved / "checkpoints" / "step-4"
    line = one_line(main(["convert", "--to-hf", str(ckpt), "--out", str(out)]), capsys.readouterr().err)
    assert "--out" in line and "pass --overwrite" in line, line
    assert files_under(out) == mine
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(out), "--overwrite"]) == 0
    assert "model-00001-of-00002.safetensors" not in files_under(out)
    assert json.loads((out / "config.json").read_text())["model_type"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-model"]  # no staging left beside it


def test_a_failed_export_leaves_nothing_half_written(saved: Path, tmp_path: Path, capsys,
                                                     monkeypatch: pytest.MonkeyPatch):
    """The disk fills while the safetensors are written: the target never appears, the staging
    folder is gone, and an existing --out --overwrite target keeps its old contents."""
    import safetensors.torch

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    ckpt = saved / "checkpoints" / "step-4"
    with pytest.raises(OSError):
        main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "new")])
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("old")
    with pytest.raises(OSError):
        main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "old"), "--overwrite"])
    assert files_under(tmp_path) == {"old/config.json": b"old"}


def test_convert_from_hf_keeps_a_tmp_sibling_and_refuses_a_full_target(saved: Path, tmp_path: Path, capsys):
    hf = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(saved / "checkpoints" / "step-4"), "--out", str(hf),
                 "--dtype", "fp32"]) == 0
    sibling = tmp_path / "ckpt.tmp"  # a user's folder that happens to be named like a staging one
    sibling.mkdir()
    (sibling / "keep.txt").write_text("mine")
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 0
    assert (sibling / "keep.txt").read_text() == "mine"
    assert checkpoint.looks_intact(tmp_path / "ckpt")
    before = files_under(tmp_path)
    line = one_line(main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "ckpt")]),
                    capsys.readouterr().err)
    assert "pass --overwrite" in line and files_under(tmp_path) == before


@pytest.mark.parametrize("command", ["estimate", "plan", "report"])
def test_named_outputs_are_refused_when_they_exist_and_defaults_kept_aside(
        command: str, saved: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    existing = tmp_path / ("out" if command == "report" else "out.json")
    if command == "report":
        existing.mkdir()
        (existing / "index.html").write_text("mine")
    else:
        existing.write_text("mine")
    before = files_under(tmp_path)
    args = {"estimate": ["estimate", "--model", "debug", "--nproc", "2", "--json", str(existing)],
            "plan": ["plan", "--model", "debug", "--nproc", "2", "--out", str(existing)],
            "report": ["report", str(saved), "--out", str(existing)]}[command]
    line = one_line(main(args), capsys.readouterr().err)
    assert "pass --overwrite" in line, line
    assert files_under(tmp_path) == before
    assert main([*args, "--overwrite"]) == 0
    assert files_under(tmp_path) != before and not list(tmp_path.glob(".*"))  # replaced, nothing staged
    if command == "plan":  # the default plan.toml: an earlier one is kept aside, with a notice
        monkeypatch.chdir(tmp_path)
        assert main(["plan", "--model", "debug", "--nproc", "2"]) == 0
        capsys.readouterr()
        assert main(["plan", "--model", "debug", "--nproc", "2"]) == 0
        said = capsys.readouterr()
        assert "notice: the earlier plan.toml is kept as plan." in said.out + said.err
        assert len(list(tmp_path.glob("plan*.toml"))) == 2


def test_an_export_is_removed_only_with_the_checkpoint_this_run_retired(saved: Path, tmp_path: Path):
    """hf/step-N went whenever checkpoint N was gone, also when the user had removed the checkpoint
    by hand (or the export was theirs): now only a recorded export whose checkpoint this run retired."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    record = RunRecord(run_dir)
    record.make_dir("hf")
    for step in (1, 2):
        record.note(f"hf/step-{step}", "tree")
        (run_dir / "hf" / f"step-{step}").mkdir()
    (run_dir / "hf" / "step-3").mkdir()  # the user's own, never recorded
    shutil.rmtree(run_dir / "checkpoints" / "step-2")  # removed by hand: its export stays
    export_hf_folder(run_dir / "checkpoints" / "step-4", run_dir, retired=[])
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step-1", "step-2", "step-3", "step-4"]
    export_hf_folder(run_dir / "checkpoints" / "step-4", run_dir, retired=[1, 3])  # exists: not redone
    shutil.rmtree(run_dir / "hf" / "step-4")
    retired = [1, 3]
    export_hf_folder(run_dir / "checkpoints" / "step-4", run_dir, retired=retired)
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step-2", "step-3", "step-4"]
    assert retired == [] and (run_dir / "hf" / "step-4" / "config.json").is_file()


def test_a_training_run_exports_and_retires_its_own(tmp_path: Path, data_cache: str):
    run_dir = tmp_path / "run"
    train_tiny(run_dir, data_cache, "--training.steps=4", "--checkpoint.interval=1",
               "--checkpoint.export_hf=true", "--checkpoint.keep_latest_k=2")
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step-3", "step-4"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-3", "step-4"]
    assert {"hf/step-4": "tree", "checkpoints/step-4": "tree"}.items() <= RunRecord(run_dir).entries().items()



def test_an_export_is_readable_by_others_and_a_run_directory_exports_its_latest(saved: Path, tmp_path: Path,
                                                                                capsys):
    """convert --to-hf of a run directory exports its latest checkpoint (as generate reads one), with
    every file readable as the rest of the folder is (safetensors writes owner-only files); an HF
    folder where a checkpoint belongs is named as such, with the way on."""
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(saved), "--out", str(out)]) == 0
    assert f"exported {saved / 'checkpoints' / 'step-4'} ->" in capsys.readouterr().out
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in out.iterdir()), {
        p.name: oct(p.stat().st_mode) for p in out.iterdir()}
    line = one_line(main(["convert", "--to-hf", str(out), "--out", str(tmp_path / "again")]),
                    capsys.readouterr().err)
    assert "is a Hugging Face model folder, not a shardwise checkpoint" in line and "--from-hf" in line


def test_download_out_stages_refuses_a_full_folder_and_overwrites_only_when_it_succeeds(tmp_path: Path):
    """`download ID --out DIR`: the files a run reads land in DIR; a DIR holding files is refused in one
    line, unchanged; `--overwrite` replaces it; a download that fails half-way (a listed file the Hub
    cannot give) leaves nothing: no DIR, no staging folder, no parent folder made for DIR, and an
    existing DIR as it was."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, text in {"config.json": '{"model_type": "qwen3"}', "model.safetensors": "weights",
                       "tokenizer.json": '{"model": {}}', "modeling_x.py": "import os"}.items():
        (repo / name).write_text(text)
    work = tmp_path / "models"
    work.mkdir()
    out, half = work / "tiny", work / "half"
    listing = lambda d: sorted(p.name for p in d.iterdir() if not p.name.startswith("."))  # noqa: E731
    broken = frozenset({"org/half/tokenizer.json"})
    with fake_hub({"org/tiny": repo, "org/half": repo}, missing=broken) as (url, _):
        env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": url}
        said = run_cli(["download", "org/tiny", "--out", str(out)], env=env).stdout
        assert f"downloaded org/tiny (model) -> {out}" in said
        assert listing(out) == ["config.json", "model.safetensors", "tokenizer.json"]  # no code
        (out / "notes.txt").write_text("mine")
        refused = run_cli(["download", "org/tiny", "--out", str(out)], env=env, check=False)
        assert refused.returncode == 2 and "--overwrite" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and (out / "notes.txt").read_text() == "mine"
        failed = run_cli(["download", "org/half", "--out", str(out), "--overwrite"], env=env, check=False)
        assert failed.returncode == 2 and "the Hub answered 404 for 'org/half'" in failed.stderr
        assert (out / "notes.txt").read_text() == "mine"  # the old folder stays when the new one fails
        failed = run_cli(["download", "org/half", "--out", str(half)], env=env, check=False)
        assert failed.returncode == 2 and not half.exists()
        nested = run_cli(["download", "org/half", "--out", str(work / "new" / "half")], env=env, check=False)
        assert nested.returncode == 2
        assert sorted(p.name for p in work.iterdir()) == ["tiny"]  # no staging folder, no folder made for it
        run_cli(["download", "org/tiny", "--out", str(out), "--overwrite"], env=env)
        assert listing(out) == ["config.json", "model.safetensors", "tokenizer.json"]
