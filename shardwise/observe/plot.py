"""Loss-curve PNG from a run's metrics.jsonl (train loss per logged step, validation loss marked)."""

from __future__ import annotations

from pathlib import Path

from shardwise.observe.metrics import read_metrics


def plot_loss(metrics_path: Path, out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2, label="train loss")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", ms=4, lw=1.2,
                label="validation loss")
    spikes = [r for r in records if "spike" in r]
    if spikes:
        ax.plot([r["step"] for r in spikes], [r["loss"] for r in spikes], "x", ms=9, mew=2, color="red",
                label="loss spike")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
