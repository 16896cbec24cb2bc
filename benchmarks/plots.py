"""Line plots for the benchmark scripts (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

Series = tuple[Sequence[float], Sequence[float]]


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); install it with: pip install matplotlib") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def line_plot(
    series: Mapping[str, Series],
    path: str | Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    note: str = "",
) -> Path:
    """One line with markers per series name (x values, y values); written as PNG to path."""
    if not series:
        raise ValueError("nothing to plot")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    try:
        for name, (xs, ys) in series.items():
            ax.plot(list(xs), list(ys), marker="o", label=name)
        if logx:
            ax.set_xscale("log", base=2)
            ticks = sorted({float(x) for xs, _ in series.values() for x in xs})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        if logy:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        if note:
            fig.text(0.01, 0.01, note, fontsize="x-small", alpha=0.8)
        fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
        return out
    finally:
        plt.close(fig)
