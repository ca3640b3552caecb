"""Pearson's chi-square test of independence on a contingency table: do two samplers draw from one distribution.

Not scipy's `chi2_contingency`: scipy is not among vLLM's dependencies, and where it is installed transformers
imports it (scipy.optimize, for a loss) in both processes of every vLLM start: 2 s of each start on one core. The
survival function is torch's regularized incomplete gamma; the statistic, with Yates' correction at one degree of
freedom, is scipy's definition.
"""

from __future__ import annotations

import numpy as np
import torch


def chi_square_p_value(table: np.ndarray) -> float:
    """The p-value that the rows of `table` (counts, no all-zero column) were drawn from one distribution."""
    observed = np.asarray(table, dtype=np.float64)
    expected = np.outer(observed.sum(axis=1), observed.sum(axis=0)) / observed.sum()
    dof = (observed.shape[0] - 1) * (observed.shape[1] - 1)
    if dof == 0:
        return 1.0
    if dof == 1:  # Yates: move each count half a unit towards its expectation, never past it
        diff = expected - observed
        observed = observed + np.sign(diff) * np.minimum(0.5, np.abs(diff))
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))
