"""`kimi-eagle bench render` on the committed results: each mode's latest run, tables and plots, into a Markdown
file between its markers, the same bytes every time, and `--check` telling a file that no longer shows them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from kimi_eagle.bench.cli import MEASURING_MODES
from kimi_eagle.bench.render import DEFAULT_FILE, OPENING
from kimi_eagle.cli import main
from tests.helpers.cli import REPO

RESULTS = REPO / "bench" / "results"
PREFIX = {"speedup": "full"}  # the others' files are named for the mode
# A line of each mode's report that only a rendering of its latest run has.
TABLE_HEADS = {"speedup": "| k | conc. | mean acc. length | per-position acceptance |",
               "configs": "| configuration | streamed, 1 in flight |",
               "tune": "| in flight | tuned | fastest other | ratio | noise band | holds |",
               "bypass": "| configuration | read | 1 in flight |",
               "guidellm": "| server | T | streams | prompts | GuideLLM |",
               "startup": "| round | start | seconds to Ready |"}


def sections(modes: list[str]) -> str:
    return "".join(f"## {mode}\n\nintro of {mode}\n\n<!-- render:{mode} -->\n<!-- /render:{mode} -->\n\nhow {mode} "
                   "is measured\n\n" for mode in modes)


def latest(mode: str) -> Path:
    prefix = PREFIX.get(mode, mode)
    return sorted(p for p in RESULTS.glob(f"{prefix}-*.json") if re.fullmatch(rf"{prefix}-\d{{8}}-\d{{6}}\.json",
                                                                              p.name))[-1]


def render(*args: str | Path) -> int:
    return main(["bench", "render", *map(str, args)])


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Every mode rendered once from the committed results: the Markdown file and the plots folder."""
    folder = tmp_path_factory.mktemp("render")
    doc = folder / "BENCH.md"
    doc.write_text("# Benchmarks\n\n" + sections(list(MEASURING_MODES)))
    assert render(doc, "--plots", folder / "plots") == 0
    return doc, folder / "plots"


def test_each_section_shows_its_modes_latest_run_and_the_text_around_it_stays(rendered: tuple[Path, Path]) -> None:
    doc, _ = rendered
    text = doc.read_text()
    for mode in MEASURING_MODES:
        section = text.split(f"<!-- render:{mode} -->\n")[1].split(f"<!-- /render:{mode} -->")[0]
        source = re.search(r"^Latest run: \[`([^`]+)`\]\(\1\)", section, re.M)[1]
        assert (doc.parent / source).resolve() == latest(mode), "a link relative to the file, to the latest run"
        assert TABLE_HEADS[mode] in section, mode
        assert section.startswith("<!-- written by `kimi-eagle bench render` from "), mode
        assert re.search(r"^### ", section, re.M) and not re.search(r"^#{1,2} ", section, re.M), \
            f"{mode}: the report's headings go two levels down"
        assert f"intro of {mode}\n\n<!-- render:{mode} -->" in text and f"-->\n\nhow {mode} is measured" in text


def test_the_plots_are_pngs_the_sections_show(rendered: tuple[Path, Path]) -> None:
    doc, plots = rendered
    shown = re.findall(r"!\[([^]]+)\]\(([^)]+)\)", doc.read_text())
    assert {Path(link).name for _, link in shown} == {p.name for p in plots.iterdir()}
    assert {"speedup-by-concurrency.png", "speedup-acceptance-by-position.png"} <= {p.name for p in plots.iterdir()}
    for title, link in shown:
        png = doc.parent / link
        with Image.open(png) as image:
            assert image.format == "PNG" and image.width >= 400 and image.height >= 300, link
            assert "Software" not in image.info and not any("date" in key.lower() for key in image.info), image.info
        assert title


def test_rendering_again_gives_the_same_bytes(rendered: tuple[Path, Path]) -> None:
    doc, plots = rendered
    before = {p: p.read_bytes() for p in [doc, *plots.iterdir()]}
    assert render(doc, "--plots", plots) == 0
    assert {p: p.read_bytes() for p in [doc, *plots.iterdir()]} == before


def test_check_passes_on_a_current_file_and_names_what_drifted(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    doc, plots = tmp_path / "B.md", tmp_path / "plots"
    doc.write_text(sections(["startup"]))
    assert render(doc, "--plots", plots) == 0
    assert render(doc, "--plots", plots, "--check") == 0
    current = doc.read_text()
    figure = re.search(r"\| 1 \| first \| (\d+\.\d)", current)[1]
    doc.write_text(current.replace(f"| 1 | first | {figure}", "| 1 | first | 1.0"))
    capsys.readouterr()
    assert render(doc, "--plots", plots, "--check") == 1
    err = capsys.readouterr().err
    assert f"{doc}: the startup section is not what {latest('startup').relative_to(REPO)} renders" in err
    assert f"run `kimi-eagle bench render {doc}`" in err
    assert "| 1 | first | 1.0" in doc.read_text(), "--check writes nothing"
    doc.write_text(current)
    (plots / "startup-seconds-to-ready.png").unlink()
    assert render(doc, "--plots", plots, "--check") == 1
    assert "startup-seconds-to-ready.png is missing" in capsys.readouterr().err
    assert not (plots / "startup-seconds-to-ready.png").exists()


def test_a_quick_run_is_never_the_latest(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(latest("startup"), results)
    shutil.copy(latest("startup"), results / "startup-quick-20991231-235959.json")
    doc = tmp_path / "B.md"
    doc.write_text(sections(["startup"]))
    assert render(doc, "--results", results, "--plots", tmp_path / "plots") == 0
    assert latest("startup").name in doc.read_text() and "startup-quick" not in doc.read_text()


def test_a_run_on_a_machine_made_slow_shows_only_in_its_own_section(tmp_path: Path) -> None:
    results, plots = tmp_path / "results", tmp_path / "plots"
    results.mkdir()
    shutil.copy(latest("guidellm"), results)
    made_slow = results / "guidellm-slow-draft-20991231-235959.json"
    made_slow.write_text(json.dumps({**json.loads(latest("guidellm").read_text()), "fault": "slow-draft"}))
    doc = tmp_path / "B.md"
    doc.write_text(sections(["guidellm", "guidellm:slow-draft"]))
    assert render(doc, "--results", results, "--plots", plots) == 0
    text = doc.read_text()
    plain = text.split("<!-- render:guidellm -->")[1].split("<!-- /render:guidellm -->")[0]
    slow = text.split("<!-- render:guidellm:slow-draft -->")[1].split("<!-- /render:guidellm:slow-draft -->")[0]
    assert latest("guidellm").name in plain and "slow-draft" not in plain
    assert made_slow.name in slow and "KIMI_EAGLE_FAULT=slow-draft" in slow
    assert {p.name for p in plots.iterdir()} == {"guidellm-speedup-over-no-draft.png",
                                                 "guidellm-slow-draft-speedup-over-no-draft.png"}
    made_slow.unlink()
    assert render(doc, "--results", results, "--plots", plots) == 2


@pytest.mark.parametrize(("text", "message"), [
    ("# no markers\n", "has no section to render: put `<!-- render:MODE -->`"),
    ("<!-- render:nosuch -->\n<!-- /render:nosuch -->\n", "no mode named nosuch"),
    ("<!-- render:tune -->\nno end\n", "`<!-- render:tune -->` needs its `<!-- /render:MODE -->`"),
])
def test_a_file_it_cannot_render_into_is_refused_and_left_alone(text: str, message: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "B.md"
    doc.write_text(text)
    assert render(doc, "--plots", tmp_path / "plots") == 2
    assert message in capsys.readouterr().err
    assert doc.read_text() == text and not (tmp_path / "plots").exists()


def test_a_mode_without_results_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "B.md"
    doc.write_text(sections(["bypass"]))
    assert render(doc, "--results", tmp_path) == 2
    assert f"no results of `kimi-eagle bench bypass` in {tmp_path} (bypass-<time>.json)" in capsys.readouterr().err


def test_benchmarks_md_shows_the_latest_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kimi-eagle bench render` after every run that BENCHMARKS.md should show."""
    monkeypatch.chdir(REPO)
    assert OPENING.search((REPO / DEFAULT_FILE).read_text()), "BENCHMARKS.md shows no mode's run"
    assert render("--check") == 0
