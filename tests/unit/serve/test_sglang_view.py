"""The SGLang side of the A/B: the draft view SGLang reads and the server command, checked for content.

SGLang cannot run here (its PyPI wheels have no CPU kernels for speculative decoding), so these tests check what we
hand it: the flat config, the nested aux ids, the weights linked (not copied) and the checkpoint left as it was."""


from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kimi_eagle.cli import main
from kimi_eagle.fixtures.pair_spec import AUX_LAYER_IDS, DRAFT_DIR, DRAFT_VOCAB_SIZE, HIDDEN, TARGET_DIR
from kimi_eagle.serve.profile import PROFILES_DIR, load_profile
from kimi_eagle.serve.sglang import (
    SGLANG_EAGLE3_ARCH,
    VIEW_MARKER,
    ViewError,
    build_sglang_command,
    default_view_dir,
    make_draft_view,
)


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def draft_copy(tmp_path: Path) -> Path:
    """A draft folder whose config a test may change: the fixture's config, its weights linked."""
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text((DRAFT_DIR / "config.json").read_text())
    (folder / "model.safetensors").symlink_to((DRAFT_DIR / "model.safetensors").resolve())
    return folder


def _edit(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_view_has_the_flat_config_sglang_reads(tmp_path: Path) -> None:
    speculators = json.loads((DRAFT_DIR / "config.json").read_text())
    view = make_draft_view(str(DRAFT_DIR), tmp_path / "view", target=str(TARGET_DIR))
    config = json.loads((Path(view.path) / "config.json").read_text())
    assert view.made and config["architectures"] == [SGLANG_EAGLE3_ARCH]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX_LAYER_IDS
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    assert config["draft_vocab_size"] == DRAFT_VOCAB_SIZE
    assert config["target_hidden_size"] == HIDDEN  # speculators' null, resolved from the target
    layer = speculators["transformer_layer_config"]
    assert layer["architectures"] == ["LlamaForCausalLM"]  # the one layer field replaced
    for key, value in layer.items():
        assert key == "architectures" or config[key] == value, key  # every other layer field, unchanged
    assert "speculators_model_type" not in config and "transformer_layer_config" not in config
    marker = json.loads((Path(view.path) / VIEW_MARKER).read_text())
    assert marker["source"] == str(DRAFT_DIR.resolve()) and marker["layout"] == 1
    assert set(marker["fields"]) == set(config)  # every field says where it came from


def test_view_links_the_weights_and_leaves_the_checkpoint_untouched(tmp_path: Path) -> None:
    before = _snapshot(DRAFT_DIR)
    listing = sorted(p.name for p in DRAFT_DIR.iterdir())
    view = Path(make_draft_view(str(DRAFT_DIR), tmp_path / "view", target=str(TARGET_DIR)).path)
    linked = [p for p in view.iterdir() if p.name not in ("config.json", VIEW_MARKER)]
    assert {p.name for p in linked} == {p.name for p in DRAFT_DIR.iterdir() if p.name != "config.json"}
    for link in linked:
        assert link.is_symlink(), f"{link.name} was copied, not linked"
        assert Path(os.readlink(link)) == (DRAFT_DIR / link.name).resolve()
    assert (view / "model.safetensors").is_symlink()
    assert not (view / "config.json").is_symlink()
    assert _snapshot(DRAFT_DIR) == before and sorted(p.name for p in DRAFT_DIR.iterdir()) == listing


def test_view_can_be_rebuilt_but_never_overwrites_other_folders(tmp_path: Path) -> None:
    out = tmp_path / "view"
    make_draft_view(str(DRAFT_DIR), out, target=str(TARGET_DIR))
    make_draft_view(str(DRAFT_DIR), out, target=str(TARGET_DIR))  # our own view of the same draft: rebuilt
    assert (out / "config.json").is_file()
    other = tmp_path / "something-else"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ViewError, match="is not a kimi-eagle view"):
        make_draft_view(str(DRAFT_DIR), other)
    assert (other / "keep.txt").read_text() == "mine"


def test_default_view_is_a_sibling_of_the_checkpoint(draft_copy: Path) -> None:
    view = make_draft_view(str(draft_copy), target=str(TARGET_DIR))
    assert Path(view.path) == default_view_dir(draft_copy) == draft_copy.parent / "draft-sglang"


@pytest.mark.parametrize(("changes", "reason"), [
    ({"norm_before_residual": True}, "does not implement"),
    ({"fc_norm": True}, "does not implement"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}, "start at 1"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4]}, "exactly 3"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, "outside the target's 0..6"),
    ({"speculators_model_type": "mlp"}, "needs an eagle3 one"),
])
def test_drafts_sglang_would_run_wrongly_are_refused(draft_copy: Path, tmp_path: Path, changes: dict,
                                                     reason: str) -> None:
    _edit(draft_copy, **changes)
    with pytest.raises(ViewError, match=reason):
        make_draft_view(str(draft_copy), tmp_path / "view", target=str(TARGET_DIR))
    assert not (tmp_path / "view").exists()


def test_missing_aux_ids_take_the_speculators_default_of_the_target(draft_copy: Path, tmp_path: Path) -> None:
    config = json.loads((draft_copy / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (draft_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ViewError, match="give --target"):
        make_draft_view(str(draft_copy), tmp_path / "view")
    view = make_draft_view(str(draft_copy), tmp_path / "view", target=str(TARGET_DIR))
    ids = json.loads((Path(view.path) / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, 3, 3]  # [2, N//2, N-3] for the fixture's 6 layers


def test_command_speculates_like_the_vllm_profile(tmp_path: Path) -> None:
    plan = build_sglang_command(load_profile("tiny-cpu-exact"), out=tmp_path / "view")  # the one naming a kernel
    argv = plan.command.argv
    assert argv[1:3] == ["-m", "sglang.launch_server"] and _flag(argv, "--model-path") == str(TARGET_DIR)
    assert _flag(argv, "--speculative-algorithm") == "EAGLE3"  # never plain EAGLE: it skips the fc fusion
    assert _flag(argv, "--speculative-num-steps") == "3"
    assert _flag(argv, "--speculative-eagle-topk") == "1"
    assert _flag(argv, "--speculative-num-draft-tokens") == "4"  # k + 1: SGLang counts the verified token
    assert _flag(argv, "--speculative-draft-model-path") == str((tmp_path / "view").absolute())
    assert "--enable-metrics" in argv
    assert _flag(argv, "--context-length") == "2048" and _flag(argv, "--dtype") == "float32"
    assert set(plan.dropped_flags) == {"kv-cache-memory-bytes", "language-model-only", "attention-backend",
                                       "max-num-queued-reqs", "distributed-executor-backend"}
    assert "--max-total-tokens" in plan.dropped_flags["kv-cache-memory-bytes"]


def test_k_and_no_draft_options(tmp_path: Path) -> None:
    argv = build_sglang_command(load_profile("tiny-cpu"), num_speculative_tokens=5, out=tmp_path / "v").command.argv
    assert (_flag(argv, "--speculative-num-steps"), _flag(argv, "--speculative-num-draft-tokens")) == ("5", "6")
    plain = build_sglang_command(load_profile("tiny-cpu"), no_draft=True).command
    assert not any(word.startswith("--speculative") for word in plain.argv) and plain.draft is None


def test_kimi_profile_translates_the_recipe() -> None:
    plan = build_sglang_command(load_profile(str(PROFILES_DIR / "kimi-k2.5-h200x8.yaml")))
    argv = plan.command.argv
    assert _flag(argv, "--tp-size") == "8" and "--trust-remote-code" in argv
    assert _flag(argv, "--tool-call-parser") == "kimi_k2" and _flag(argv, "--reasoning-parser") == "kimi_k2"
    assert _flag(argv, "--speculative-draft-model-path") == "lightseekorg/kimi-k2.5-eagle3"  # a hub draft: as is
    assert "mm-encoder-tp-mode" in plan.dropped_flags and "enable-auto-tool-choice" in plan.dropped_flags


def test_api_key_is_required_off_loopback_and_redacted() -> None:
    from kimi_eagle.serve.command import CommandError

    with pytest.raises(CommandError, match="API key"):
        build_sglang_command(load_profile("tiny-cpu"), no_draft=True, host="0.0.0.0")
    command = build_sglang_command(load_profile("tiny-cpu"), no_draft=True, host="0.0.0.0", api_key="s3cret").command
    assert _flag(command.argv, "--api-key") == "s3cret" and "s3cret" not in command.printable()


def test_cli_prints_the_command_and_what_it_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sglang-command", "--out", str(tmp_path / "view"), "--", "--mem-fraction-static", "0.8"]) == 0
    captured = capsys.readouterr()
    assert "sglang.launch_server" in captured.out and "--speculative-algorithm EAGLE3" in captured.out
    assert captured.out.rstrip().endswith("--mem-fraction-static 0.8")
    assert "--kv-cache-memory-bytes left out" in captured.err
    assert (tmp_path / "view" / "config.json").is_file()


def test_cli_refusal_is_one_clear_line(draft_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit(draft_copy, norm_before_residual=True)
    assert main(["sglang-command", "--draft", str(draft_copy), "--out", str(tmp_path / "view")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi-eagle sglang-command: ") and "norm_before_residual" in err
    assert "Traceback" not in err


def test_doctor_finds_nothing_sglang_specific_in_the_view(tmp_path: Path) -> None:
    """The same draft straight from speculators gets `sglang-config-format`; the view must come out clean."""
    from kimi_eagle.checks import run_static_checks

    raw = {f.code for f in run_static_checks(DRAFT_DIR, TARGET_DIR) if f.engine == "sglang"}
    assert "sglang-config-format" in raw
    view = Path(make_draft_view(str(DRAFT_DIR), tmp_path / "view", target=str(TARGET_DIR)).path)
    assert [f.code for f in run_static_checks(view, TARGET_DIR) if f.engine == "sglang"] == []

