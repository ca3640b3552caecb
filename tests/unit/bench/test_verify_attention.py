"""The verification-attention benchmark times two ways of doing the same work: vLLM's CPU MLA decode kernel on the
plugin's one row per query token, and one causal product per request (tests/unit/adapter/test_plugin.py checks the
kernel's rows against a reference attention)."""

from __future__ import annotations

import pytest
import torch

from kimi_eagle.bench.verify_attention import VerifyBatch, main


@pytest.mark.parametrize("query_len", [1, 2, 5])
def test_both_timed_formulations_give_the_same_attention(query_len: int) -> None:
    batch = VerifyBatch([5, 17, 33, 160], query_len, torch.float32)  # contexts across block boundaries
    torch.testing.assert_close(batch.folded(), batch.kernel(), atol=1e-5, rtol=1e-4)


def test_it_prints_one_row_per_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--dtype", "float32", "--requests", "1", "3", "--context", "40", "--repeats", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 3"]
