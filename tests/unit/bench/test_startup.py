"""`bench --startup`: its verdict against the second-start goal, its report, and a start that never gets ready."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.bench import startup
from kimi_eagle.bench.stats import spread
from kimi_eagle.serve.launch import ServerStartError
from kimi_eagle.serve.profile import load_profile


def test_the_verdict_judges_every_later_start_by_its_slowest() -> None:
    first, fast, slow = spread([86.0, 90.2]), spread([31.2, 33.0]), spread([31.2, 46.0])
    assert startup.verdict(first, fast) == ("first start (nothing compiled) 88.1 s [86.0-90.2] to Ready, every later "
                                            "start 32.1 s [31.2-33.0] (meets the 45 s goal)")
    assert "misses the 45 s goal" in startup.verdict(first, slow)  # one slow second start is a miss


def test_the_report_lists_each_start_with_what_the_cache_held(tmp_path: Path) -> None:
    from kimi_eagle.bench.run import machine_now

    starts = [startup.Start(round=1, start="first", seconds_to_ready=86.0, cache_files_before=0),
              startup.Start(round=1, start="second", seconds_to_ready=31.2, cache_files_before=41)]
    first, second = spread([86.0]), spread([31.2])
    result = startup.StartupResult(command="kimi-eagle bench --startup", started_utc="2026-12-01T15:00:00Z",
                                   duration_s=130, machine=machine_now((0.0, 0.0, 0.0)), profile="tiny-cpu",
                                   plan=startup.FULL, starts=starts, first=first, second=second,
                                   verdict=startup.verdict(first, second))
    text = startup.markdown(result)
    assert "| 1 | first | 86.0 | 0 |" in text and "| 1 | second | 31.2 | 41 |" in text
    assert "**first start (nothing compiled) 86.0 s to Ready, every later start 31.2 s (meets" in text


def test_a_start_that_never_prints_its_ready_line_is_a_start_error_naming_its_log(tmp_path: Path) -> None:
    """A real `kimi-eagle serve` whose pre-flight refuses the target: it exits without a Ready line."""
    profile = load_profile("tiny-cpu").model_copy(update={"target": str(tmp_path / "no-such-model")})
    bench = startup.StartupBench(startup.QUICK, profile, target=None, draft=None, prompts=[], files_dir=tmp_path,
                                 command_line="kimi-eagle bench --startup --quick", say=print)
    with pytest.raises(ServerStartError, match="did not print its Ready line") as raised:
        bench.run()
    log = tmp_path / "logs" / "first-r1.log"
    assert str(log) in str(raised.value) and "no-such-model" in log.read_text()
