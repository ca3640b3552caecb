"""The benchmark's plots, drawn with matplotlib: the same results give the same PNG bytes (no date or software version
in the file, matplotlib's default style whatever a matplotlibrc says), so a rendered plot changes in git only when
its figures do."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib as mpl
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from kimi_eagle.bench.stats import Spread
from kimi_eagle.loadtest.files import write_atomic

DPI = 100
TARGET_ALONE = "target alone"


@dataclass(frozen=True)
class Plot:
    path: Path
    title: str  # what the plot shows: its alt text where a rendered file shows it


def draw(path: Path, title: str, paint: Callable[[Figure], None], *, size: tuple[float, float] = (7.0, 4.0)) -> Plot:
    """A figure of `size` inches painted by `paint`, titled, written to `path` as PNG."""
    with mpl.style.context("default"):
        figure = Figure(figsize=size, dpi=DPI, layout="constrained")
        paint(figure)
        figure.suptitle(title, fontsize="medium")
        png = io.BytesIO()
        figure.savefig(png, format="png", dpi=DPI, metadata={"Software": None})
    write_atomic(path, png.getvalue())
    return Plot(path=path, title=title)


def log2_axis(ax: Axes, values: Sequence[int], label: str) -> None:
    """An x axis of requests in flight (or streams): doublings evenly spaced, a tick at each value measured."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values), labels=[str(v) for v in values])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)


def spread_line(ax: Axes, xs: Sequence[float], spreads: Sequence[Spread], label: str, **style: object) -> None:
    """Medians joined by a line, each with its [min, max] over the rounds as an error bar."""
    medians = [s.median for s in spreads]
    below = [s.median - s.min for s in spreads]
    above = [s.max - s.median for s in spreads]
    ax.errorbar(xs, medians, yerr=[below, above], marker="o", capsize=3, label=label, **style)


def reference(ax: Axes, y: float, label: str, *, color: str = "grey") -> None:
    ax.axhline(y, color=color, linestyle=":", linewidth=1, label=label)
