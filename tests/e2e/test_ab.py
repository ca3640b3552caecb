"""`kimi-eagle ab` for real: a speculating against a plain vLLM server."""


from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.loadtest.ab import AbSummary
from tests.helpers.cli import exit_message, run_cli


@pytest.mark.e2e
def test_real_ab_speculation_against_none(spec_server, plain_server, tmp_path: Path) -> None:
    out = tmp_path / "ab"
    result = run_cli("ab", "--a", spec_server.url, "--b", plain_server.url, "--rounds", "2", "--run-time", "20s",
                     "--max-tokens", "32", "--max-requests", "6", "--out", str(out), timeout=600)
    assert result.returncode == 0, exit_message(result)
    report = (out / "report.md").read_text()
    summary = AbSummary.model_validate_json((out / "ab_summary.json").read_text())
    assert [s.acceptance.speculation for s in summary.a.rounds if s.acceptance] == ["on", "on"]
    assert [s.acceptance.speculation for s in summary.b.rounds if s.acceptance] == ["off", "off"]
    assert all(s.acceptance and (s.acceptance.mean_acceptance_length or 0) > 1 for s in summary.a.rounds)
    assert all((s.throughput.output_tokens_per_s or 0) > 0 for s in summary.a.rounds + summary.b.rounds)
    throughput_row = next(line for line in report.splitlines() if line.startswith("| output tokens/s |"))
    assert "n/a" not in throughput_row.split("|")[2] and "n/a" not in throughput_row.split("|")[3]
    assert "- B: no speculation" in report
    assert "| num_speculative_tokens | 3 | 0 | DIFFERS |" in report  # the point of this A/B, said plainly
    for name in ("latency_cdf.png", "rounds.png", "acceptance_per_position.png", "round1-A/requests.jsonl",
                 "round2-B/locust_stats.csv"):
        assert (out / name).is_file(), name
    table = [line for line in report.splitlines() if line.startswith("| ")]
    print("\nA/B e2e report table:\n" + "\n".join(table))

