"""The draft guards on Model Runner V2's own code, the path every CUDA GPU takes in vLLM 0.32.

Each fault the V1 tests serve through a real engine (tests/e2e/test_guards.py, test_draft_layouts.py, the static
checks) runs here through V2's loading and capture functions (`tests/helpers/v2_path.py` says which, and what of V2
cannot run without Triton), in one child process for all cases (about 8 s). Each must end where V1 ends: served
with the draft's own aux layers, or refused with the message that names its cause.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, MLA_DRAFT_DIR, TARGET_DIR
from tests.helpers import broken_drafts as bd
from tests.helpers.cli import REPO
from tests.helpers.v2_path import RESULT_MARK, WITHOUT_EAGLE3

pytestmark = pytest.mark.xdist_group("v2-path")
TRAINED_IDS = [2, 4, 6]


def _target_without_eagle3(out: Path) -> Path:
    shutil.copytree(TARGET_DIR, out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [WITHOUT_EAGLE3]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _cases(work: Path) -> dict[str, dict]:
    target = str(TARGET_DIR)
    return {
        "healthy": {"target": target, "draft": str(DRAFT_DIR)},
        "ids only in eagle_config (SpecForge copy)": {"target": target, "draft": str(bd.specforge_copy(work / "sf"))},
        "ids only in eagle_config (MLA draft)": {"target": target, "draft": str(MLA_DRAFT_DIR)},
        "target captures one layer": {"target": target, "draft": str(DRAFT_DIR),
                                      "env": {"KIMI_EAGLE_FAULT": "aux-single-layer"}},
        "unfilled draft parameters": {"target": target, "env": {"KIMI_EAGLE_STATIC_CHECKS": "0"},
                                      "draft": str(bd.draft_without(work / "unfilled", "fc.weight",
                                                                    "layers.0.mlp.down_proj.weight"))},
        "fc sized for one layer": {"target": target, "draft": str(bd.build("fc_one_layer", work))},
        "ids written as strings": {"target": target, "draft": str(bd.build("aux_ids_strings", work))},
        "target class without SupportsEagle3": {"target": str(_target_without_eagle3(work / "no-eagle3")),
                                                "draft": str(DRAFT_DIR), "register_without_eagle3": True},
    }


def _run(work: Path, cases: dict[str, dict], env: dict[str, str] | None = None) -> dict[str, dict]:
    (work / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-m", "tests.helpers.v2_path", str(work / "cases.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    line = next((line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)), None)
    assert line is not None, done.stderr[-4000:]
    return json.loads(line.removeprefix(RESULT_MARK))


@pytest.fixture(scope="module")
def on_v2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("v2-path")
    return _run(work, _cases(work))


@pytest.mark.parametrize("case", ["healthy", "ids only in eagle_config (SpecForge copy)",
                                  "ids only in eagle_config (MLA draft)"])
def test_v2_captures_the_layers_the_draft_was_trained_on(on_v2: dict[str, dict], case: str) -> None:
    """Without the plugin V2 reads no `eagle_config` ids and captures the model's default (2, 3, 3) here."""
    assert on_v2[case] == {"stage": "served", "captured": TRAINED_IDS, "width": 3 * 256, "fused": 256}


def test_a_target_capturing_one_layer_is_named_at_v2s_first_step(on_v2: dict[str, dict]) -> None:
    result = on_v2["target captures one layer"]
    assert (result["stage"], result["error"], result["width"]) == ("first step", "DraftRefusedError", 256)
    assert result["message"].startswith("the draft's fc expects 768 = 3 aux layers [2, 4, 6] x hidden 256, but the "
                                        "target sent 256 (1 layer(s))")


def test_unfilled_draft_parameters_are_refused_by_v2s_draft_loading(on_v2: dict[str, dict]) -> None:
    result = on_v2["unfilled draft parameters"]
    assert (result["stage"], result["error"]) == ("draft", "DraftRefusedError")
    assert "leaves 2 parameter(s) unfilled" in result["message"]
    assert "fc" in result["message"] and "down_proj" in result["message"]


def test_an_fc_sized_for_one_layer_is_refused_by_v2s_draft_loading(on_v2: dict[str, dict]) -> None:
    result = on_v2["fc sized for one layer"]
    assert (result["stage"], result["error"]) == ("draft", "DraftRefusedError")
    assert "[fc-width] fc does not fit the aux states the engine feeds it" in result["message"]


def test_ids_written_as_strings_are_refused_where_the_config_is_built(on_v2: dict[str, dict]) -> None:
    result = on_v2["ids written as strings"]
    assert (result["stage"], result["error"]) == ("config", "DraftRefusedError")
    assert "'2', '4', '6' are not JSON integers" in result["message"]
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 6]' in result["message"]


def test_a_target_class_without_eagle3_is_refused_where_the_config_is_built(on_v2: dict[str, dict]) -> None:
    result = on_v2["target class without SupportsEagle3"]
    assert (result["stage"], result["error"]) == ("config", "DraftRefusedError")
    assert f"target class {WITHOUT_EAGLE3} does not expose EAGLE-3 aux hidden states" in result["message"]


def test_without_the_guards_v2_misreads_both_id_faults(tmp_path: Path) -> None:
    """What the guards stand in front of, on V2's own code: SpecForge's ids unread (the default captured instead:
    two distinct layers of this 6-layer target, so its fc fails; on Kimi-K2.5's 61 layers the default is three
    layers, the same width, and nothing fails), and string ids capturing nothing, which V2's step cannot unpack."""
    cases = _cases(tmp_path)
    results = _run(tmp_path, {name: cases[name] for name in ("ids only in eagle_config (SpecForge copy)",
                                                             "ids written as strings")},
                   env={"KIMI_EAGLE_RUNTIME_CHECKS": "0"})
    specforge, strings = results.values()
    assert (specforge["stage"], specforge["width"]) == ("first step", 2 * 256), specforge
    assert (strings["stage"], strings["message"]) == ("target step", "too many values to unpack (expected 2)")
