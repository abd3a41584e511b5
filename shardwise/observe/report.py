"""``shardwise report RUN_DIR [RUN_DIR ...]``: a self-contained HTML page plus PNGs of one or more
runs, overlaid for comparison.

Panels: loss (train, validation as markers, loss spikes as red crosses), learning rate, gradient
norm, tokens/s, MFU and executed-FLOPs utilization, peak memory per rank, step time per rank (with the
straggler ratio); for an MoE run, its expert load as a heatmap of MoE blocks x steps.
The PNGs are written next to the page and embedded in it (base64), so the HTML file alone can be
mailed or attached to an issue.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from shardwise.config.schema import ConfigError
from shardwise.observe.metrics import read_metrics

# (file stem, title, y label, metric keys); a key ending in _per_rank is drawn once per rank.
PANELS = [
    ("loss", "Loss", "cross-entropy (nats/token)", ["loss", "val_loss"]),
    ("lr", "Learning rate", "lr", ["lr"]),
    ("grad_norm", "Gradient norm (before clipping)", "L2 norm", ["grad_norm"]),
    ("tokens_per_s", "Throughput", "tokens/s (all ranks)", ["tokens_per_s"]),
    ("utilization", "Utilization", "fraction of peak", ["mfu", "exec_util"]),
    ("memory", "Peak memory per rank", "GiB", ["memory_gib_per_rank"]),
    ("step_time", "Step time per rank", "seconds", ["step_time_s_per_rank"]),
]


def load_run(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "metrics.jsonl"
    records = read_metrics(path)
    if not records:
        raise ConfigError(f"{path} has no metrics: is '{run_dir}' a run directory?")
    config = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").is_file() else ""
    return {"name": run_dir.name, "dir": run_dir, "records": records, "config": config}


def _series(records: list[dict], key: str) -> list[tuple[str, list[int], list[float]]]:
    """[(label suffix, steps, values)] for one metric key (one per rank for *_per_rank keys)."""
    rows = [r for r in records if key in r]
    if not rows:
        return []
    if key.endswith("_per_rank"):
        n = len(rows[0][key])
        return [(f"rank {i}", [r["step"] for r in rows], [r[key][i] for r in rows]) for i in range(n)]
    return [("", [r["step"] for r in rows], [r[key] for r in rows])]


def plot_panel(runs: list[dict], stem: str, title: str, ylabel: str, keys: list[str],
               out: Path) -> dict[str, int]:
    """Draw one panel for all runs into ``out``; returns {line label: points drawn} (empty: no
    data, no file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4), dpi=110)
    lines: dict[str, int] = {}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        for j, key in enumerate(keys):
            for k, (suffix, steps, values) in enumerate(_series(run["records"], key)):
                label = " ".join(x for x in (run["name"] if len(runs) > 1 else "", key, suffix) if x)
                style = "o" if key.startswith("val_") else ("-" if j == 0 else "--")
                ax.plot(steps, values, style, ms=4, lw=1.3, label=label,
                        color=colors[(i * 3 + j + k) % len(colors)])
                lines[label] = len(steps)
        spikes = [r for r in run["records"] if "spike" in r] if stem == "loss" else []
        if spikes:  # training.spike's marks: the steps a user should look at
            label = " ".join(x for x in (run["name"] if len(runs) > 1 else "", "loss spike") if x)
            ax.plot([r["step"] for r in spikes], [r["loss"] for r in spikes], "x", ms=9, mew=2,
                    color="red", label=label)
            lines[label] = len(spikes)
    if lines:
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out)
    plt.close(fig)
    return lines


def plot_expert_load(runs: list[dict], out: Path) -> dict[str, list[int]]:
    """MoE: each run's per-block expert load (``expert_load_layers``) as a blocks x steps heatmap,
    one row of panels per run, into ``out``; returns {run label: [blocks, steps]} (empty: no MoE run,
    no file). The colour scale runs from 1 (balanced) to the worst load any run logged."""
    maps = []
    for run in runs:
        rows = [r for r in run["records"] if isinstance(r.get("expert_load_layers"), dict)]
        if rows:
            blocks = sorted(rows[0]["expert_load_layers"], key=int)
            grid = [[r["expert_load_layers"].get(b, float("nan")) for r in rows] for b in blocks]
            maps.append((run["name"], blocks, [r["step"] for r in rows], grid))
    if not maps:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(max(max(row) for row in grid) for *_, grid in maps)
    height = sum(1.4 + 0.25 * len(blocks) for _, blocks, _, _ in maps)
    fig, axes = plt.subplots(len(maps), 1, figsize=(7.5, height), dpi=110, squeeze=False)
    for ax, (name, blocks, steps, grid) in zip(axes[:, 0], maps, strict=True):
        span = (steps[0] - 0.5, steps[-1] + 0.5, len(blocks) - 0.5, -0.5)  # (x: steps, y: blocks)
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma_r", vmin=1.0,
                          vmax=max(top, 1.5), extent=span)
        ax.set_yticks(range(len(blocks)), [f"block {b}" for b in blocks], fontsize=7)
        ax.set_xlabel("step")
        suffix = f" - {name}" if len(maps) > 1 else ""
        ax.set_title(f"Expert load (busiest expert / mean){suffix}", fontsize=10)
        fig.colorbar(image, ax=ax, label="load")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return {name: [len(blocks), len(steps)] for name, blocks, steps, _ in maps}


def summary_rows(run: dict) -> list[tuple[str, str]]:
    recs = run["records"]
    last = recs[-1]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    tail = recs[len(recs) // 2:]  # second half: past warm-up

    def mean(key: str) -> float | None:
        xs = [r[key] for r in tail if key in r]
        return sum(xs) / len(xs) if xs else None

    rows = [("steps logged", f"{len(recs)} (last step {last['step']})"),
            ("final train loss", f"{last['loss']:.4f}"),
            ("final validation loss", f"{vals[-1]:.4f}" if vals else "-")]
    spikes = [r for r in recs if "spike" in r]
    marks = ", ".join(f"step {r['step']} ({r['spike']:.2f}x)" for r in spikes)
    rows.append(("loss spikes (training.spike)", marks or "none"))
    loads = [r["expert_load"] for r in tail if "expert_load" in r]
    if loads:  # MoE
        rows.append(("expert load, worst block (second half: mean, max)", f"{sum(loads) / len(loads):.2f}, "
                     f"{max(loads):.2f}"))
    for key, label, fmt in (("tokens_per_s", "tokens/s (second half, mean)", "{:,.0f}"),
                            ("mfu", "MFU, PaLM convention (second half)", "{:.2%}"),
                            ("exec_util", "executed-FLOPs utilization (second half)", "{:.2%}"),
                            ("straggler_ratio", "slowest / median rank step time", "{:.2f}")):
        v = mean(key)
        rows.append((label, fmt.format(v) if v is not None else "-"))
    if "memory_gib_per_rank" in last:
        per_rank = ", ".join(f"{m:.2f}" for m in last["memory_gib_per_rank"])
        rows.append(("peak memory per rank (GiB)", per_rank))
    return rows


def write_report(run_dirs: list[Path], out: Path) -> Path:
    """Write ``out/report.html`` and ``out/<panel>.png``; returns the HTML path."""
    runs = [load_run(Path(d)) for d in run_dirs]
    if len({r["name"] for r in runs}) < len(runs):  # same folder names: label by path instead
        for r in runs:
            r["name"] = str(r["dir"])
    out.mkdir(parents=True, exist_ok=True)
    figures, manifest = [], {}
    for stem, title, ylabel, keys in PANELS:
        png = out / f"{stem}.png"
        if lines := plot_panel(runs, stem, title, ylabel, keys, png):
            figures.append((title, png))
            manifest[stem] = lines
    if maps := plot_expert_load(runs, out / "expert_load.png"):
        figures.append(("Expert load per MoE block", out / "expert_load.png"))
        manifest["expert_load"] = maps
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>shardwise report</title>",
             "<style>body{font-family:sans-serif;margin:2em;max-width:1600px}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px}"
             ".grid{display:flex;flex-wrap:wrap;gap:12px}.grid figure{margin:0}"
             "pre{background:#f6f6f6;padding:8px;font-size:12px;max-height:20em;overflow:auto}</style>"
             "</head><body>", "<h1>shardwise report</h1>"]
    for run in runs:
        parts.append(f"<h2>{html.escape(run['name'])}</h2><p>{html.escape(str(run['dir']))}</p><table>")
        parts += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                  for k, v in summary_rows(run)]
        parts.append("</table>")
        if run["config"]:
            parts.append(f"<details><summary>config.toml</summary><pre>{html.escape(run['config'])}</pre>"
                         "</details>")
    parts.append("<div class='grid'>")
    for title, png in figures:
        data = base64.b64encode(png.read_bytes()).decode()
        parts.append(f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{html.escape(title)} ({png.name})</figcaption></figure>")
    parts.append("</div>")
    # What each panel shows, machine-readable: {panel: {line label: points}}.
    parts.append(f"<script type='application/json' id='panels'>{json.dumps(manifest)}</script>")
    parts.append("</body></html>")
    page = out / "report.html"
    page.write_text("\n".join(parts))
    return page


def screenshot(page: Path, png: Path, width: int = 1600, height: int = 2600) -> Path:
    """Render ``page`` in headless Chromium (Debian's ``chromium``) and save a PNG of it."""
    import shutil
    import subprocess

    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(n)), None)
    if exe is None:
        raise FileNotFoundError("no chromium on PATH: install Debian's chromium (apt-get install "
                                "chromium) to render the report")
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={png.absolute()}",
                    page.absolute().as_uri()], check=True, capture_output=True, timeout=120)
    return png
