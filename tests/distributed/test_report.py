"""``shardwise report`` on real runs: the page, its PNGs, and the lines in each panel."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import MOE_ARGS, TINY_ARGS, metrics, need, run_cli

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory, data_cache: str) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    common = ["train", *TINY_ARGS, f"--data.cache_dir={data_cache}", "--training.steps=8",
              "--eval.interval=4", "--eval.steps=1", "--data.val_fraction=0.2"]
    run_cli([*common, f"--run.dir={tmp / 'one'}"])
    # the second is an MoE model over two ranks (expert parallel): its expert loads make a heatmap
    run_cli([*common, f"--run.dir={tmp / 'two'}", "--nproc=2", *MOE_ARGS, "--parallel.ep=2"])
    return tmp


def test_report_of_two_real_runs(two_runs: Path, tmp_path: Path):
    out = tmp_path / "report"
    proc = run_cli(["report", str(two_runs / "one"), str(two_runs / "two"), f"--out={out}"])
    page = (out / "report.html").read_text()
    assert "report.html" in proc.stdout
    manifest = re.search(r"<script type='application/json' id='panels'>(.*?)</script>", page)
    panels = json.loads(manifest.group(1))
    steps = len(metrics(two_runs / "one"))
    assert steps == 8
    # Every panel a person needs, each line with the run's number of logged points.
    assert panels["loss"]["one loss"] == steps and panels["loss"]["two loss"] == steps
    assert panels["loss"]["one val_loss"] == 2  # evaluated at steps 4 and 8
    assert panels["utilization"]["two mfu"] == steps and panels["utilization"]["two exec_util"] == steps
    assert panels["memory"].keys() == {"one memory_gib_per_rank rank 0", "two memory_gib_per_rank rank 0",
                                       "two memory_gib_per_rank rank 1"}
    assert panels["step_time"]["two step_time_s_per_rank rank 1"] == steps
    for stem in ("loss", "lr", "grad_norm", "tokens_per_s", "utilization", "memory", "step_time"):
        png = (out / f"{stem}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, stem
    # MoE: every block's load at every logged step, as a heatmap of blocks x steps (two's only)
    loads = [r["expert_load_layers"] for r in metrics(two_runs / "two")]
    assert len(loads) == steps and all(r.keys() == {"1"} for r in loads)  # block 0 is dense
    assert all(r["expert_load"] == max(r["expert_load_layers"].values()) >= 1.0
               for r in metrics(two_runs / "two"))
    assert panels["expert_load"] == {"two": [1, steps]}
    heat = (out / "expert_load.png").read_bytes()
    assert heat[:8] == b"\x89PNG\r\n\x1a\n" and len(heat) > 10_000
    assert "expert load, worst block" in page and "expert load, worst block" not in page.split("<h2>two")[0]
    assert page.count("data:image/png;base64,") == 8  # embedded: the page stands alone


def test_report_screenshot_in_headless_chromium(two_runs: Path, tmp_path: Path):
    need("chromium (Debian's package; .ci/run installs it)", shutil.which("chromium") is not None)
    out = tmp_path / "report"
    run_cli(["report", str(two_runs / "one"), str(two_runs / "two"), f"--out={out}", "--screenshot"])
    check_screenshot(out / "report.png")


def check_screenshot(png: Path) -> None:
    """The rendered page is a real picture: big, and mostly not one colour (the plots are drawn)."""
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(png).convert("L"), dtype=np.float32)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1500
    assert img.std() > 10  # a blank or error page is nearly uniform
    assert (img < 128).mean() > 0.01  # dark pixels: text, axes and curves


def test_report_refuses_a_folder_without_metrics(tmp_path: Path):
    proc = run_cli(["report", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "has no metrics.jsonl" in proc.stderr
