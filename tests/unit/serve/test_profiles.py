"""Every profile, checked with vLLM's own parser and config classes, as `serve --dry-run` does."""


from __future__ import annotations

import importlib.util
import json
import os
import shlex

import pytest

from kimi_eagle.cli import main
from kimi_eagle.cpu_kernels import kernel_report
from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
from kimi_eagle.serve.command import CommandError, build_command
from kimi_eagle.serve.profile import PROFILES_DIR, Profile, available_profiles, load_profile
from kimi_eagle.serve.validate import validate_with_vllm

KIMI_PROFILES = [name for name in available_profiles() if name.startswith("kimi-k2.5-")]


KIMI_TARGET, KIMI_DRAFT = "moonshotai/Kimi-K2.5", "lightseekorg/kimi-k2.5-eagle3"


def _profile(name: str) -> Profile:
    # By path: a name with a dot ("k2.5") is taken for a file name by load_profile (see the report).
    return load_profile(str(PROFILES_DIR / f"{name}.yaml"))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_production_profiles_exist() -> None:
    assert set(KIMI_PROFILES) == {"kimi-k2.5-h200x8", "kimi-k2.5-text-h200x8", "kimi-k2.5-2node-ray"}


@pytest.mark.parametrize("name", available_profiles())
def test_every_profile_passes_vllms_config_classes(name: str) -> None:
    profile = _profile(name)
    assert profile.needs.strip()
    report = validate_with_vllm(build_command(profile))
    assert any(line.startswith("the engine config vLLM starts from") for line in report.checked), report.render()
    assert any("only a GPU run shows" in line for line in report.not_checked)


@pytest.mark.parametrize("name", KIMI_PROFILES)
def test_kimi_profiles_carry_the_published_recipe(name: str) -> None:
    command = build_command(_profile(name))
    argv = command.argv
    assert _flag(argv, "--model") == KIMI_TARGET and "--trust-remote-code" in argv
    assert _flag(argv, "--tool-call-parser") == "kimi_k2" and _flag(argv, "--reasoning-parser") == "kimi_k2"
    assert "--enable-auto-tool-choice" in argv
    spec = json.loads(_flag(argv, "--speculative-config"))
    assert spec == {"model": KIMI_DRAFT, "method": "eagle3", "num_speculative_tokens": 3}
    multimodal = "--language-model-only" not in argv
    assert (_flag(argv, "--mm-encoder-tp-mode") == "data") if multimodal else ("--mm-encoder-tp-mode" not in argv)


def test_each_kimi_variant_is_what_its_name_says() -> None:
    one_node = build_command(_profile("kimi-k2.5-h200x8")).argv
    text = build_command(_profile("kimi-k2.5-text-h200x8")).argv
    two_nodes = build_command(_profile("kimi-k2.5-2node-ray")).argv
    assert _flag(one_node, "--tensor-parallel-size") == "8" and "--language-model-only" not in one_node
    assert _flag(text, "--tensor-parallel-size") == "8" and "--language-model-only" in text
    assert _flag(two_nodes, "--tensor-parallel-size") == "16"
    assert _flag(two_nodes, "--distributed-executor-backend") == "ray"
    assert "--pipeline-parallel-size" not in two_nodes


def test_published_checkpoints_are_validated_through_stand_ins() -> None:
    report = validate_with_vllm(build_command(_profile("kimi-k2.5-h200x8")))
    checked = "\n".join(report.checked)
    assert f"the target {KIMI_TARGET} through a config-only stand-in" in checked
    assert f"the draft {KIMI_DRAFT} through a config-only stand-in" in checked
    assert "KimiK25ForConditionalGeneration, compressed-tensors" in checked
    assert "TP 8" in checked and "eagle3, 3 tokens, draft LlamaForCausalLMEagle3" in checked
    assert any("own tokenizer" in line for line in report.not_checked)


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed: the real backend is built")
def test_ray_profile_says_the_cluster_was_not_checked() -> None:
    report = validate_with_vllm(build_command(_profile("kimi-k2.5-2node-ray")))
    assert "TP 16" in "\n".join(report.checked)
    assert any(line.startswith("the Ray cluster: Ray is not installed here") for line in report.not_checked)


@pytest.mark.parametrize(("extra", "reason"), [
    (["--tensor-parallel-size", "7"], "must be divisible by tensor parallel size"),
    (["--pipeline-parallel-size", "2"], "loses the aux hidden states"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--max-model-len", "999999999"], "max_model_len"),
    (["--tool-call-parser", ""], "--enable-auto-tool-choice requires --tool-call-parser"),
])
def test_impossible_settings_fail_before_any_loading(extra: list[str], reason: str) -> None:
    command = build_command(_profile("kimi-k2.5-h200x8"), extra_args=extra)
    with pytest.raises(CommandError, match=reason) as caught:
        validate_with_vllm(command)
    assert "usage:" not in str(caught.value) and "kimi-eagle-stand-in" not in str(caught.value)


def test_validation_leaves_the_environment_alone() -> None:
    before = dict(os.environ)
    validate_with_vllm(build_command(load_profile("tiny-cpu")))
    assert dict(os.environ) == before  # vLLM's CPU platform writes worker settings while building the config


def test_the_dry_run_reports_the_executor_vllm_will_use_under_the_profiles_env() -> None:
    """tiny-cpu runs the worker inside the engine core. vLLM's CPU platform silently turns `uni` back into `mp`
    unless V1 multiprocessing is off, so the config is built under the profile's env and says which won."""
    command = build_command(load_profile("tiny-cpu"))
    assert command.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    checked = " ".join(validate_with_vllm(command).checked)
    assert "executor uni, the worker inside the engine core process" in checked
    command.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert "executor mp, a worker process per rank" in " ".join(validate_with_vllm(command).checked)


def test_serve_dry_run_prints_the_validated_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "tiny-cpu", "--dry-run"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    machine = kernel_report()
    # its first line: the ISA and the kernel build, which a speed or a fault seen here may be particular to
    first = err.splitlines()[0]
    assert first.startswith(f"kimi-eagle serve: CPU {machine.cpu}: {machine.isa}; vLLM CPU kernels "
                            f"{machine.kernel_build} (built for {machine.built_for};"), first
    words = shlex.split(out.strip().splitlines()[-1])
    assert _flag(words, "--model") == str(TARGET_DIR)
    assert json.loads(_flag(words, "--speculative-config"))["model"] == str(DRAFT_DIR)


@pytest.mark.parametrize("name", KIMI_PROFILES)
def test_serve_dry_run_of_each_production_profile_by_name(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Exactly what a user types on the GPU host before downloading anything."""
    assert main(["serve", name, "--dry-run"]) == 0, capsys.readouterr().err
    words = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert _flag(words, "--model") == KIMI_TARGET
    assert json.loads(_flag(words, "--speculative-config"))["model"] == KIMI_DRAFT


def test_profile_bounds_the_queue_and_n() -> None:
    """An unbounded queue turns overload into ever-growing waits: the profile sets vLLM's admission limit
    (beyond it: 503 'The engine is currently busy ...') and a cap on n per request."""
    command = build_command(load_profile("tiny-cpu"))
    argv = command.argv
    queued = int(argv[argv.index("--max-num-queued-reqs") + 1])
    batch = int(argv[argv.index("--max-num-seqs") + 1])
    assert batch <= queued <= 16 * batch
    assert 1 <= int(command.env["VLLM_MAX_N_SEQUENCES"]) <= queued



def _with_schedule(schedule: list) -> Profile:
    profile = load_profile("tiny-cpu")
    speculative = profile.speculative.model_copy(update={"num_speculative_tokens": 4,
                                                         "num_speculative_tokens_per_batch_size": schedule})
    return profile.model_copy(update={"speculative": speculative})


def test_a_profiles_schedule_reaches_vllm_and_the_dry_run_expands_it_as_the_scheduler_will() -> None:
    command = build_command(_with_schedule([[1, 1, 4], [2, 4, 3], [5, 16, 0]]))
    spec = json.loads(_flag(command.argv, "--speculative-config"))
    assert spec["num_speculative_tokens"] == 4
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 4, 3], [5, 16, 0]]
    report = validate_with_vllm(command)
    assert "batch size 1: k=4, 2-4: k=3, 5-16: k=0" in "\n".join(report.checked)


def test_a_fixed_k_asked_for_replaces_the_schedule() -> None:
    command = build_command(_with_schedule([[1, 16, 2]]), num_speculative_tokens=3)
    spec = json.loads(_flag(command.argv, "--speculative-config"))
    assert spec["num_speculative_tokens"] == 3 and "num_speculative_tokens_per_batch_size" not in spec


@pytest.mark.parametrize(("schedule", "reason"), [
    ([[2, 16, 3]], "must start at 1"),
    ([[1, 8, 3], [4, 16, 2]], "non-overlapping"),
])
def test_a_schedule_vllms_scheduler_would_refuse_fails_the_dry_run(schedule: list, reason: str) -> None:
    with pytest.raises(CommandError, match=reason):
        validate_with_vllm(build_command(_with_schedule(schedule)))


def test_a_schedule_above_the_profiles_k_is_refused_where_vllm_would_cap_it() -> None:
    from kimi_eagle.serve.profile import Speculative

    with pytest.raises(ValueError, match="vLLM would cap it there silently"):
        Speculative(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=[[1, 4, 5], [5, 16, 2]])


def test_write_schedule_keeps_the_profiles_comments_and_loads(tmp_path) -> None:
    from kimi_eagle.serve.profile import write_schedule

    path = tmp_path / "p.yaml"
    path.write_text((PROFILES_DIR / "tiny-cpu.yaml").read_text())
    write_schedule(path, [(1, 4, 4), (5, 16, 2)], source="bench/results/tune-x.json")
    write_schedule(path, [(1, 2, 3), (3, 16, 0)], source="bench/results/tune-y.json")  # replaces, never duplicates
    text = path.read_text()
    assert text.count("num_speculative_tokens_per_batch_size:") == 1 and "tune-y.json" in text
    assert "tune-x.json" not in text and "# The default profile" in text
    profile = load_profile(str(path))
    assert profile.speculative.num_speculative_tokens == 3
    assert profile.speculative.num_speculative_tokens_per_batch_size == [(1, 2, 3), (3, 16, 0)]
