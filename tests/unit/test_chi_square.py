"""The chi-square test the sampling tests use (tests/helpers/chi_square.py) gives scipy's p-values."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.chi_square import chi_square_p_value


@pytest.mark.parametrize(("table", "scipy_p"), [
    ([[10, 20], [20, 10]], 0.02013675155034633),  # one degree of freedom: Yates' correction
    ([[30, 10, 5], [22, 15, 9]], 0.1860905791499325),
    ([[64, 0, 0], [50, 8, 6]], 0.0003860092894690547),
], ids=["2x2-yates", "2x3", "2x3-far-apart"])
def test_p_values_are_scipys(table: list[list[int]], scipy_p: float) -> None:
    """Reference values from `scipy.stats.chi2_contingency(table).pvalue`, scipy 1.17.1."""
    assert chi_square_p_value(np.array(table)) == pytest.approx(scipy_p, rel=1e-9)


def test_the_same_counts_are_one_distribution() -> None:
    assert chi_square_p_value(np.array([[12, 30, 7], [12, 30, 7]])) == pytest.approx(1.0)
    assert chi_square_p_value(np.array([[40], [25]])) == 1.0  # one column: nothing to compare
