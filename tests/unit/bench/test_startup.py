"""`bench startup`: its verdict against the second-start goal, its report, and a start that never gets ready."""

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


def test_the_verdict_names_a_second_start_that_compiled_again_or_answered_otherwise() -> None:
    def starts(loaded: bool, second_answer: list[int]) -> list[startup.Start]:
        return [startup.Start(round=1, start="first", seconds_to_ready=86.0, cache_files_before=0,
                              loaded_compiled_target=False, answer_token_ids=[5, 6, 7]),
                startup.Start(round=1, start="second", seconds_to_ready=31.2, cache_files_before=41,
                              loaded_compiled_target=loaded, answer_token_ids=second_answer)]

    first, second = spread([86.0]), spread([31.2])
    assert startup.verdict(first, second, starts(True, [5, 6, 7])) == startup.verdict(first, second)
    assert "compiled the target again instead of loading it" in startup.verdict(first, second, starts(False, [5, 6, 7]))
    assert "answered otherwise than the first" in startup.verdict(first, second, starts(True, [5, 6, 8]))


def test_the_report_lists_each_start_with_what_the_cache_held(tmp_path: Path) -> None:
    from kimi_eagle.bench.machine import machine_now

    starts = [startup.Start(round=1, start="first", seconds_to_ready=86.0, cache_files_before=0,
                            loaded_compiled_target=False, answer_token_ids=[1, 2, 3]),
              startup.Start(round=1, start="second", seconds_to_ready=31.2, cache_files_before=41,
                            loaded_compiled_target=True, answer_token_ids=[1, 2, 3])]
    first, second = spread([86.0]), spread([31.2])
    result = startup.StartupResult(command="kimi-eagle bench startup", started_utc="2026-12-01T15:00:00Z",
                                   duration_s=130, machine=machine_now((0.0, 0.0, 0.0)), profile="tiny-cpu",
                                   plan=startup.FULL, starts=starts, first=first, second=second,
                                   verdict=startup.verdict(first, second, starts))
    text = startup.markdown(result)
    assert "| 1 | first | 86.0 | 0 | compiled | 3 tokens |" in text
    assert "| 1 | second | 31.2 | 41 | loaded | as the first |" in text
    assert "**first start (nothing compiled) 86.0 s to Ready, every later start 31.2 s (meets" in text
    assert f"CPUs, {result.machine.isa} (vLLM kernels {result.machine.vllm_kernels}), vLLM" in text  # measured on


def test_a_quick_rounds_cache_links_the_ambient_kernels_and_counts_no_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    ambient = tmp_path / "ambient"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(ambient))
    kernel = ambient / "torch_compile_cache" / "inductor_shared" / "ab" / "kernel.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"compiled")
    cache = tmp_path / "round"
    startup.link_shared_kernels(cache)
    startup.link_shared_kernels(cache)  # a second round's call on the same folder is harmless
    link = cache / "torch_compile_cache" / "inductor_shared"
    assert link.is_symlink() and (link / "ab" / "kernel.so").read_bytes() == b"compiled"
    assert sum(1 for p in cache.rglob("*") if p.is_file()) == 0  # what `cache_files_before` counts
    shutil.rmtree(cache)  # as the round ends
    assert kernel.exists(), "removing a round's cache must leave the ambient kernels"


def test_a_start_that_never_prints_its_ready_line_is_a_start_error_naming_its_log(tmp_path: Path) -> None:
    """A real `kimi-eagle serve` whose pre-flight refuses the target: it exits without a Ready line."""
    profile = load_profile("tiny-cpu").model_copy(update={"target": str(tmp_path / "no-such-model")})
    bench = startup.StartupBench(startup.QUICK, profile, target=None, draft=None, prompts=[], files_dir=tmp_path,
                                 command_line="kimi-eagle bench startup --quick", say=print)
    with pytest.raises(ServerStartError, match="did not print its Ready line") as raised:
        bench.run()
    log = tmp_path / "logs" / "first-r1.log"
    assert str(log) in str(raised.value) and "no-such-model" in log.read_text()
