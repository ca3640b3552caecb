"""`kimi-eagle bench MODE`: one subcommand per mode, each registered by its own module, no mode importing another;
the spellings of before (`kimi-eagle bench --tune`, plain `kimi-eagle bench`) refused with the spelling of now."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from kimi_eagle.bench import guidellm
from kimi_eagle.bench.cli import MEASURING_MODES, OLD_FLAGS, bench_parser
from kimi_eagle.cli import main
from tests.helpers.cli import REPO

MODES = [*MEASURING_MODES, "render"]


def test_each_mode_is_one_subcommand_defined_in_the_module_of_its_name() -> None:
    parser = bench_parser()
    listed = [line.split()[0] for line in parser.format_help().splitlines() if line.startswith("    ")
              and line.split()[0] in MODES]
    assert listed == MODES, "`kimi-eagle bench --help` lists each mode once, in this order"
    for mode in MODES:
        run = parser.parse_args([mode]).run
        assert getattr(run, "func", run).__module__ == f"kimi_eagle.bench.{mode}"


def test_no_mode_imports_another() -> None:
    """The helpers the modes share live in modules of their own (subcommand, machine, result, plots, ...)."""
    for mode in MODES:
        source = REPO / "bench" / f"{mode}.py"
        imported = {node.module for node in ast.walk(ast.parse(source.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {f"kimi_eagle.bench.{alias.name}" for node in ast.walk(ast.parse(source.read_text()))
                     if isinstance(node, ast.ImportFrom) and node.module == "kimi_eagle.bench" for alias in node.names}
        others = sorted(m for m in imported if m.removeprefix("kimi_eagle.bench.") in set(MODES) - {mode})
        assert not others, f"bench/{mode}.py imports the modes {others}"


@pytest.mark.parametrize(("words", "now"), [
    ([], "kimi-eagle bench speedup"),
    (["--quick", "--profile", "tiny-cpu-exact"], "kimi-eagle bench speedup --quick --profile tiny-cpu-exact"),
    (["--report", "bench/results/full-20261130-071300.json"],
     "kimi-eagle bench speedup --report bench/results/full-20261130-071300.json"),
    *(([flag, "--quick"], f"kimi-eagle bench {mode} --quick") for flag, mode in OLD_FLAGS.items()),
    (["--quick", "--tune", "--write-profile"], "kimi-eagle bench tune --quick --write-profile"),
    (["speedup", "--startup"], "kimi-eagle bench startup"),  # what `make bench ARGS=--startup` runs
])
def test_a_spelling_of_before_is_refused_with_the_spelling_of_now(words: list[str], now: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *words, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi-eagle bench: the modes are subcommands now") and f"`{now} --out {tmp_path}`" in err
    assert not any(tmp_path.iterdir()), "a refused spelling runs nothing"


def test_two_old_modes_at_once_are_two_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--tune", "--configs"]) == 2
    assert "`kimi-eagle bench tune` (`make bench MODE=tune`) and `kimi-eagle bench configs`" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [m for m in MEASURING_MODES if m != "guidellm"])
def test_each_measuring_mode_checks_its_profile_before_starting_anything(mode: str, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", mode, "--profile", "no-such-profile", "--out", str(tmp_path)]) == 2
    assert "known profiles" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_guidellm_is_looked_for_before_anything_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(guidellm.GUIDELLM_ENV, str(tmp_path / "nowhere" / "guidellm"))
    assert main(["bench", "guidellm", "--profile", "no-such-profile"]) == 2
    assert "make guidellm" in capsys.readouterr().err


def test_an_option_of_another_mode_is_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["bench", "tune", "--dtype", "float32"])
    assert refused.value.code == 2 and "unrecognized arguments: --dtype float32" in capsys.readouterr().err


def test_make_bench_runs_the_mode_it_is_given() -> None:
    def bench_line(*make_args: str) -> str:
        done = subprocess.run(["make", "-n", *make_args], cwd=REPO, capture_output=True, text=True, check=True)
        return next(line for line in done.stdout.splitlines() if "kimi-eagle bench" in line).split("kimi-eagle ")[1]

    assert bench_line("bench").split() == ["bench", "speedup"]
    assert bench_line("bench", "MODE=tune", "ARGS=--quick --write-profile").split() == \
        ["bench", "tune", "--quick", "--write-profile"]
    assert bench_line("bench-guidellm", "ARGS=--quick").split() == ["bench", "guidellm", "--quick"]
