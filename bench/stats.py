"""Repeated measurements reduced to what the benchmark reports: median with min and max, never a lone mean."""

from __future__ import annotations

import statistics

from pydantic import BaseModel, Field


class Spread(BaseModel):
    """Median, min and max of `n` repeats of one measurement."""

    n: int = Field(description="Number of repeats.")
    median: float
    min: float
    max: float

    def cell(self, ratio: Spread | None = None, digits: int = 0, ratio_digits: int = 2) -> str:
        """`median [min-max]` for a results table, then the ratio's median in bold when there is one."""
        text = f"{self.median:.{digits}f} [{self.min:.{digits}f}-{self.max:.{digits}f}]"
        return text + (f" **{ratio.median:.{ratio_digits}f}x**" if ratio is not None else "")

    @property
    def relative_range(self) -> float:
        """(max - min) / median: the noise band of this measurement."""
        return (self.max - self.min) / self.median if self.median else float("inf")


def spread(values: list[float]) -> Spread | None:
    """None for no values: an unknown figure stays unknown."""
    if not values:
        return None
    return Spread(n=len(values), median=statistics.median(values), min=min(values), max=max(values))


def paired_ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Round-by-round ratios of an interleaved A/B measurement (B_i / A_i): slow drift of the machine cancels."""
    if len(numerators) != len(denominators):
        raise ValueError(f"paired measurements need as many B as A repeats ({len(numerators)} vs "
                         f"{len(denominators)})")
    return [b / a for b, a in zip(numerators, denominators) if a > 0]
