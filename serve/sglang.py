"""The SGLang side of the A/B: the same target and draft as a vLLM profile, as an SGLang server command.

SGLang 0.5.23 cannot read a speculators checkpoint ("Unrecognized model ... Should have a `model_type` key") and takes
the aux layer ids only from a nested `eagle_config`; without them it silently falls back to `[2, N//2, N-3]`. So we
write a *draft view*: a sibling folder that SGLang reads, next to the checkpoint, which stays untouched.

Layout of a view (what `doctor` may rely on)::

    <view>/
      config.json           the flat config below
      kimi-eagle-view.json  {"made_by": "kimi-eagle sglang-command", "layout": 1, "source": <checkpoint, absolute>,
                             "fields": {<config.json key>: <where its value came from>}}
      <every other file of the checkpoint>   a symlink to the original file (weights are linked, never copied;
                                             sub-folders are not linked: SGLang reads none)

`config.json`, field by field (SGLang's reader is `python/sglang/srt/models/llama_eagle3.py` and, for the aux ids,
`ModelRunner`, which reads `hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]` of the draft):

- every field of the speculators `transformer_layer_config` (the draft layer's HF Llama config: `model_type`,
  `hidden_size`, heads, `head_dim`, `intermediate_size`, RoPE, norms, `vocab_size` ...), unchanged;
- `architectures: ["LlamaForCausalLMEagle3"]`: the class SGLang registers for EAGLE-3 Llama drafts;
- `draft_vocab_size`: from the speculators config. SGLang sizes `lm_head` with it; left out, SGLang would use the
  full vocabulary and take the target's lm_head;
- `target_hidden_size`: from the speculators config, or (when that is null, meaning "same as the target") the
  target's `text_config.hidden_size`, else the layer's `hidden_size`. SGLang sizes `fc` as 3 x this width and only
  checks `hasattr`, so it must be a number, never null;
- `eagle_config: {"eagle_aux_hidden_state_layer_ids": [...], "use_aux_hidden_state": true}`: the ids from the
  speculators top level (or speculators' own default `[2, N//2, N-3]` of the target's N layers when absent);
- `torch_dtype`: the speculators `dtype`.

Weights keep the speculators names (`layers.0.*`, `fc.weight`, `d2t`, `t2d`): SGLang 0.5.23's `llama_eagle3.py`
accepts `layers.0.*` and maps the legacy `midlayer.*`; `d2t` becomes its hot-token map and `t2d` is skipped
(`sglang/srt/models/llama_eagle3.py`, `load_weights`). Older SGLang releases know only `midlayer.*` and drop
`layers.0.*` without a word: run `kimi-eagle doctor` against the SGLang version you serve with.

A flat draft (SpecForge's layout) is used as it is when SGLang reads it faithfully. An MLA draft
(`Eagle3DeepseekV2ForCausalLM`, SGLang's `kimi_k25_eagle3.py`) under vLLM's other name for the class
(`Eagle3DeepseekV3ForCausalLM`) gets a view that renames the class, nothing else.

Refused, because SGLang would run the draft wrongly without a word: speculators options SGLang's draft class does not
implement (`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`), a layer type other than Llama, a
number of aux states other than 3, aux ids out of the target's range, and aux ids starting at 1, which SGLang's
DeepseekV2 (Kimi-K2.5's language model) shifts by one layer (`set_eagle3_layers_to_capture`: "if layer_ids[0] == 1").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimi_eagle.checks.layout import (
    MLA_DRAFT_ARCHITECTURES,
    SGLANG_MLA_ARCHITECTURE,
    DraftConfigError,
    default_aux_ids,
    draft_spec,
)
from kimi_eagle.serve.command import API_KEY_ENV, CommandError, ServeCommand, is_loopback
from kimi_eagle.serve.profile import Profile, resolve_model_path

VIEW_MARKER = "kimi-eagle-view.json"
VIEW_LAYOUT = 1
SGLANG_EAGLE3_ARCH = "LlamaForCausalLMEagle3"
SGLANG_DEFAULT_PORT = 30000
NUM_AUX_HIDDEN_STATES = 3  # SGLang's fc takes exactly three aux states (llama_eagle3.py: hidden_size_in * 3)

# vLLM flag -> SGLang flag, checked against SGLang's server_args.
VLLM_TO_SGLANG_FLAGS: dict[str, str] = {
    "tensor-parallel-size": "tp-size",
    "max-model-len": "context-length",
    "max-num-seqs": "max-running-requests",
    "dtype": "dtype",
    "tool-call-parser": "tool-call-parser",
    "reasoning-parser": "reasoning-parser",
}
# vLLM flags with no SGLang counterpart: left out, and said why.
LEFT_OUT_FLAGS: dict[str, str] = {
    "enable-auto-tool-choice": "SGLang chooses tools automatically once --tool-call-parser is set",
    "gpu-memory-utilization": "SGLang's --mem-fraction-static counts differently: set it after `--`",
    "kv-cache-memory-bytes": "SGLang sizes its KV pool in tokens (--max-total-tokens) or as a share "
                             "(--mem-fraction-static): set one after `--`",
    "mm-encoder-tp-mode": "no SGLang counterpart",
    "language-model-only": "no SGLang switch known here: SGLang loads the vision tower too",
    "distributed-executor-backend": "SGLang spans nodes with --nnodes, --node-rank and --dist-init-addr on every "
                                    "node: add them after `--`",
    "attention-backend": "SGLang names its backends differently",
    "max-num-queued-reqs": "a bound on queued requests: its SGLang counterpart is not checked here: add it after `--`",
}


class ViewError(ValueError):
    """A draft SGLang cannot be given faithfully; the message names the problem and the fix."""


@dataclass
class DraftView:
    """Where SGLang reads the draft, and what was done to get there."""

    path: str
    source: str
    made: bool = False
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ViewError(f"cannot read {path}: {exc}") from None


def _target_text_config(target: str | None) -> dict[str, Any] | None:
    if target is None or not (Path(target) / "config.json").is_file():
        return None
    config = _read_json(Path(target) / "config.json")
    return config.get("text_config") or config


def default_view_dir(draft_dir: Path) -> Path:
    """The sibling folder next to the checkpoint: `<draft>-sglang`."""
    return draft_dir.parent / f"{draft_dir.name}-sglang"


def sglang_draft_config(speculators: dict[str, Any], target_text: dict[str, Any] | None) -> tuple[dict, dict]:
    """The flat config SGLang reads, and where each of its fields came from."""
    try:
        spec = draft_spec(speculators)
    except DraftConfigError as exc:
        raise ViewError(f"the draft config: {exc}") from None
    if spec.format != "speculators":
        raise ViewError("the draft config has no transformer_layer_config: is it a speculators EAGLE-3 checkpoint?")
    layer = spec.layer_config
    if spec.model_type != "llama":
        raise ViewError(f"the draft layer is {spec.model_type!r}; SGLang's EAGLE-3 draft class "
                        f"({SGLANG_EAGLE3_ARCH}) is a Llama layer: train the draft with a llama layer")
    on = spec.options_on
    if on:
        raise ViewError(f"the draft sets {', '.join(on)}, which SGLang's {SGLANG_EAGLE3_ARCH} does not implement: "
                        "SGLang would run a different network than the one trained; compare on vLLM only")
    num_layers = target_text.get("num_hidden_layers") if target_text else None
    aux_ids = spec.declared_ids
    fields = {key: "transformer_layer_config" for key in layer}
    if aux_ids is None:
        if num_layers is None:
            raise ViewError("the draft config has no eagle_aux_hidden_state_layer_ids and the target's layer count "
                            "is unknown: give --target DIR (a folder with the target's config.json)")
        aux_ids = default_aux_ids(num_layers)
        fields["eagle_config"] = "speculators' default [2, N//2, N-3] of the target's N layers"
    else:
        fields["eagle_config"] = "speculators config: eagle_aux_hidden_state_layer_ids"
    aux_ids = [int(i) for i in aux_ids]
    if len(aux_ids) != NUM_AUX_HIDDEN_STATES:
        raise ViewError(f"the draft reads {len(aux_ids)} aux hidden states ({aux_ids}); SGLang's fc takes exactly "
                        f"{NUM_AUX_HIDDEN_STATES}")
    if aux_ids[0] == 1:
        raise ViewError(f"the aux layer ids {aux_ids} start at 1: SGLang's DeepseekV2 (Kimi-K2.5) then captures "
                        f"layers {[i + 1 for i in aux_ids]}, one later than vLLM; retrain with ids that do not start "
                        "at 1, e.g. speculators' default [2, N//2, N-3]")
    if num_layers is not None and not all(0 <= i <= num_layers for i in aux_ids):
        raise ViewError(f"aux layer ids {aux_ids} are outside the target's 0..{num_layers}")
    target_hidden = spec.declared_target_hidden_size
    fields["target_hidden_size"] = "speculators config: target_hidden_size"
    if target_hidden is None:
        if target_text and target_text.get("hidden_size"):
            target_hidden, fields["target_hidden_size"] = target_text["hidden_size"], "target: text_config.hidden_size"
        else:
            target_hidden = layer["hidden_size"]
            fields["target_hidden_size"] = "transformer_layer_config.hidden_size (speculators: null = same width)"
    config = dict(layer)
    config.update(
        architectures=[SGLANG_EAGLE3_ARCH],
        draft_vocab_size=spec.draft_vocab_size,
        target_hidden_size=target_hidden,
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
    )
    fields["architectures"] = f"SGLang's EAGLE-3 Llama draft class ({SGLANG_EAGLE3_ARCH})"
    fields["draft_vocab_size"] = ("speculators config: draft_vocab_size" if spec.declared_draft_vocab_size
                                  else "transformer_layer_config.vocab_size")
    if spec.dtype:
        config["torch_dtype"], fields["torch_dtype"] = spec.dtype, "speculators config: dtype"
    return config, fields


def make_draft_view(draft: str, out: Path | None = None, *, target: str | None = None) -> DraftView:
    """The folder to give SGLang as `--speculative-draft-model-path` for this draft.

    A speculators checkpoint gets a view (written, or rewritten when it is already our view of the same source); a
    folder that is already in SGLang's format is used as it is; anything else (a hub name) is passed through."""
    source = Path(draft)
    if not (source / "config.json").is_file():
        return DraftView(path=draft, source=draft, notes=[
            f"{draft} is not a local folder: passed to SGLang as it is, not checked (published EAGLE-3 drafts for "
            "SGLang are usually in its own format already)"])
    speculators = _read_json(source / "config.json")
    if "speculators_model_type" not in speculators:
        return _flat_draft_view(source, speculators, out)
    if speculators.get("speculators_model_type") != "eagle3":
        raise ViewError(f"{source} is a speculators {speculators.get('speculators_model_type')!r} draft; "
                        "SGLang's EAGLE3 algorithm needs an eagle3 one")
    config, fields = sglang_draft_config(speculators, _target_text_config(target))
    return _write_view(source, out, config, fields)


def _flat_draft_view(source: Path, config: dict[str, Any], out: Path | None) -> DraftView:
    """A flat (SpecForge) draft: used as it is where SGLang reads it faithfully, a view where only the class name
    differs (vLLM's `Eagle3DeepseekV3ForCausalLM` for an MLA draft), refused where SGLang would run it wrongly."""
    try:
        spec = draft_spec(config)
    except DraftConfigError as exc:
        raise ViewError(f"{source}/config.json: {exc}") from None
    wanted = SGLANG_MLA_ARCHITECTURE if spec.mla else SGLANG_EAGLE3_ARCH
    renamable = spec.mla and set(spec.architectures) & set(MLA_DRAFT_ARCHITECTURES)
    if wanted not in spec.architectures and not renamable:
        raise ViewError(f"{source}/config.json is neither a speculators EAGLE-3 config nor SGLang's {wanted} "
                        f"(architectures {spec.architectures}, {spec.model_type} layer): give an EAGLE-3 draft")
    on = spec.options_on
    if on:
        raise ViewError(f"the draft sets {', '.join(on)}, which SGLang 0.5.23's {wanted} does not implement "
                        "(EAGLE-3.1's fc_norm / norm_output came in a later SGLang): SGLang would run a different "
                        "network than the one trained; compare on vLLM only, or on an SGLang that reads them")
    if spec.mla and not spec.mla.q_lora_rank:
        raise ViewError(f"the MLA draft layer has no q_lora_rank, which SGLang's {wanted} requires")
    has_ids = spec.eagle_config_ids is not None
    ids_note = "" if has_ids else "; it has no eagle_config aux ids, so SGLang captures layers [2, N//2, N-3]"
    if wanted in spec.architectures:
        return DraftView(path=str(source), source=str(source),
                         notes=[f"{source} is already in SGLang's format: used as it is{ids_note}"])
    fields = {key: "the draft's config.json" for key in config}
    fields["architectures"] = f"SGLang registers its MLA draft class only as {wanted} (vLLM knows both names)"
    return _write_view(source, out, {**config, "architectures": [wanted]}, fields)


def _write_view(source: Path, out: Path | None, config: dict[str, Any], fields: dict[str, str]) -> DraftView:
    view = (out or default_view_dir(source)).absolute()
    _prepare_view_dir(view, source.resolve())
    for item in sorted(source.iterdir()):
        if item.name in ("config.json", VIEW_MARKER) or not item.is_file():
            continue
        (view / item.name).symlink_to(item.resolve())
    (view / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    marker = {"made_by": "kimi-eagle sglang-command", "layout": VIEW_LAYOUT, "source": str(source.resolve()),
              "fields": fields}
    (view / VIEW_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return DraftView(path=str(view), source=str(source.resolve()), made=True,
                     notes=[f"SGLang draft view of {source}: {view} (config rewritten, weights linked)"])


def _prepare_view_dir(view: Path, source: Path) -> None:
    if view == source or source in view.parents:
        raise ViewError(f"the view {view} would be inside the checkpoint {source}: choose --out elsewhere")
    if view.exists() or view.is_symlink():
        marker = view / VIEW_MARKER
        ours = marker.is_file() and _read_json(marker).get("source") == str(source)
        if not ours:
            raise ViewError(f"{view} exists and is not a kimi-eagle view of {source}: remove it or choose --out")
        shutil.rmtree(view)  # only links and two small json files: the checkpoint is elsewhere
    view.mkdir(parents=True)


@dataclass
class SGLangPlan:
    """The SGLang command, the draft it reads, and the profile flags it could not carry over."""

    command: ServeCommand
    view: DraftView | None
    dropped_flags: dict[str, str] = field(default_factory=dict)


def build_sglang_command(profile: Profile, *, target: str | None = None, draft: str | None = None,
                         no_draft: bool = False, num_speculative_tokens: int | None = None, host: str | None = None,
                         port: int | None = None, api_key: str | None = None, out: Path | None = None,
                         python: str | None = None, extra_args: list[str] | None = None) -> SGLangPlan:
    """The SGLang server for the profile's target and draft, speculating exactly as the vLLM profile does."""
    target_path = resolve_model_path(target or profile.target)
    draft_ref = None if no_draft else (draft or profile.draft)
    host = host or profile.host
    port = port or SGLANG_DEFAULT_PORT
    api_key = api_key or os.environ.get(API_KEY_ENV)
    if not is_loopback(host) and not api_key:
        raise CommandError(f"binding {host} exposes the server beyond this machine: give an API key "
                           f"(--api-key KEY or {API_KEY_ENV}=KEY), or bind 127.0.0.1")
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", target_path,
            "--served-model-name", profile.served_model_name, "--host", host, "--port", str(port),
            "--enable-metrics"]  # sglang:spec_accept_length and friends exist only with it
    if profile.trust_remote_code:
        argv.append("--trust-remote-code")
    dropped: dict[str, str] = {}
    for name, value in profile.vllm_args.items():
        flag = name.replace("_", "-")
        if flag not in VLLM_TO_SGLANG_FLAGS:
            dropped[flag] = LEFT_OUT_FLAGS.get(flag, "no SGLang counterpart known here: translate it yourself")
        elif value is True:
            argv.append(f"--{VLLM_TO_SGLANG_FLAGS[flag]}")
        elif value not in (False, None):
            argv += [f"--{VLLM_TO_SGLANG_FLAGS[flag]}", str(value)]
    view = None
    if draft_ref:
        view = make_draft_view(resolve_model_path(draft_ref), out, target=target_path)
        steps = num_speculative_tokens or profile.speculative.num_speculative_tokens
        # EAGLE3, never EAGLE: EAGLE with an EAGLE-3 draft skips the fc fusion and accepts nothing (notes/sglang.md).
        # k draft steps with top-k 1 is a chain; SGLang counts the verified root too, so k + 1 draft tokens
        # (server_args.py forces num_draft_tokens = num_steps + 1 when topk == 1).
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", view.path,
                 "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(steps + 1)]
    if api_key:
        argv += ["--api-key", api_key]
    argv += extra_args or []
    command = ServeCommand(argv=argv, env={}, url=f"http://{host}:{port}", served_model_name=profile.served_model_name,
                           target=target_path, draft=view.path if view else None, api_key=api_key)
    return SGLangPlan(command=command, view=view, dropped_flags=dropped)
