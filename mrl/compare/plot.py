"""PNG plots for `mrl compare`: each chosen metric against step, one line per run.

Uses matplotlib's Agg backend (no display needed). One file per metric, named after its key
(`reward/mean` -> `reward_mean.png`), and `overview.png` with every metric in a grid.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Mapping, Sequence

from mrl.compare.data import Point
from mrl.errors import UserError


def file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", key).strip("_") + ".png"


def _draw(ax, key: str, series: Mapping[str, Sequence[Point]]) -> None:
    for label, points in series.items():
        if not points:
            continue
        marker = "o" if len(points) <= 20 else None
        ax.plot([p.step for p in points], [p.value for p in points], label=label, marker=marker, markersize=3)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, alpha=0.3)


def write_plots(out_dir: str | Path, histories: Mapping[str, Mapping[str, Sequence[Point]]]) -> list[Path]:
    """`histories[key][run label]` -> points; writes one PNG per key and the overview; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create the directory ({e.strerror})") from None
    written = []
    for key, series in histories.items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        _draw(ax, key, series)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / file_name(key)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if len(histories) > 1:
        cols = min(3, len(histories))
        rows = math.ceil(len(histories) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
        for ax, (key, series) in zip(axes.flat, histories.items()):
            _draw(ax, key, series)
        for ax in list(axes.flat)[len(histories):]:
            ax.set_visible(False)
        legend = {}
        for ax in axes.flat:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        fig.legend(list(legend.values()), list(legend), loc="upper center", ncol=min(len(legend), 6),
                   fontsize="small")
        fig.tight_layout(rect=(0, 0, 1, 0.94))
        path = out / "overview.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
