"""Memory samples taken over a long run (the soak, the chaos soak): each a dict of ``seconds``,
``completed`` (requests so far) and MiB per series. Their trends, their CSV and their plot."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

AXES = ("seconds", "completed")


def series(samples: list[dict]) -> list[str]:
    """The measured series of ``samples``, sorted."""
    return sorted({k for s in samples for k in s} - set(AXES))


def growth_per_10k(samples: list[dict], key: str, total: int) -> float:
    """Least-squares slope of ``key`` (MiB) against requests completed, per 10 000 requests,
    over the samples after the first tenth of the run (warm-up)."""
    points = [(s["completed"], s[key]) for s in samples
              if s["completed"] >= total / 10 and key in s]
    if len(points) < 3 or points[-1][0] == points[0][0]:
        return float("nan")
    x, y = np.array(points, dtype=float).T
    return float(np.polyfit(x, y, 1)[0] * 10_000)


def trends(samples: list[dict], total: int) -> tuple[dict[str, tuple[float, float]],
                                                     dict[str, float]]:
    """Per series: (first, last) sample, and the growth per 10 000 requests of ``total``."""
    first_last, growth = {}, {}
    for key in series(samples):
        values = [s[key] for s in samples if key in s]
        first_last[key] = (values[0], values[-1])
        growth[key] = growth_per_10k(samples, key, total)
    return first_last, growth


def write_csv(samples: list[dict], path: Path) -> None:
    """One row per sample: the axes, then every series."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*AXES, *series(samples)])
        writer.writeheader()
        writer.writerows(samples)


def plot(path: Path, lines: dict[str, tuple[list, list]], title: str, xlabel: str, ylabel: str,
         marks: list[float] = ()) -> bool:
    """``lines`` (label -> x values, y values) into a PNG, with a dotted vertical line at each
    of ``marks``; False if matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for label, (x, y) in lines.items():
        ax.plot(x, y, label=label)
    for mark in marks:
        ax.axvline(mark, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True
