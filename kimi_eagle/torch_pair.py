"""The pair as PyTorch modules, read from their on-disk layouts, for what runs without an engine: doctor's probe,
the tests that predict acceptance, the fixtures' training. The target (a Kimi-K2.5 checkpoint: `language_model.*`,
one tensor per expert, sharded or not) becomes transformers' DeepseekV3 in float32; the draft (speculators or
SpecForge layout, a Llama or an MLA layer, EAGLE-3.1's flags) becomes `Eagle3Draft`, which computes what vLLM's
EAGLE-3 draft classes compute."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from kimi_eagle.checks.checkpoint import open_checkpoint
from kimi_eagle.checks.layout import draft_spec
from kimi_eagle.draft_model import Eagle3Draft

EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Fields of a vLLM Kimi-K2.5 text config that transformers' DeepseekV3Config does not take.
VLLM_ONLY_FIELDS = ("model_type", "architectures", "dtype", "topk_method", "scoring_func")


class PairLoadError(ValueError):
    """The checkpoint does not fit the module it is loaded into; the message says what did not fit."""


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(folder)
    out: dict[str, torch.Tensor] = {}
    for file in sorted({info.file for info in checkpoint.tensors.values()}):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return out


def target_state(folder: Path) -> dict[str, torch.Tensor]:
    """The language model's tensors under transformers' DeepseekV3 names, float32 (experts fused as transformers
    keeps them: gate_up_proj [E, 2I, H] with the gate half first, down_proj [E, H, I])."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in _tensors(folder).items():
        name = name.removeprefix("language_model.")
        if not name.startswith(("model.", "lm_head.")):
            continue  # vision tower, projector
        if m := EXPERT.match(name):
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor.float()
        else:
            state[name] = tensor.float()
    for prefix in {p for p, _ in experts}:
        gates, ups, downs = (experts[(prefix, k)] for k in ("gate_proj", "up_proj", "down_proj"))
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat([gates[e], ups[e]]) for e in sorted(gates)])
        state[prefix + "down_proj"] = torch.stack([downs[e] for e in sorted(downs)])
    return state


def load_target_model(folder: Path):
    """The target as transformers' `DeepseekV3ForCausalLM`, float32, in eval mode."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = open_checkpoint(folder).config
    text = config.get("text_config") or config
    if text.get("model_type") != "deepseek_v3":
        raise PairLoadError(f"a DeepSeek-V3-family target (Kimi-K2.5) is needed; this one is "
                            f"{text.get('model_type')!r}")
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in text.items() if k not in VLLM_ONLY_FIELDS}))
    missing, unexpected = model.to(torch.float32).load_state_dict(target_state(folder), strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise PairLoadError(f"the target's tensors do not fit DeepseekV3ForCausalLM: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    return model.eval()


def load_draft_model(folder: Path, target) -> tuple[Eagle3Draft, int]:
    """(the draft as `Eagle3Draft`, float32, in eval mode; the number of aux layers its fc reads). What the
    checkpoint does not hold is taken as vLLM takes it: the embedding from the target, identity vocabulary maps."""
    checkpoint = open_checkpoint(folder)
    spec = draft_spec(checkpoint.config)
    layer = checkpoint.config.get("transformer_layer_config") or checkpoint.config
    state = {k.replace("midlayer.", "layers.0."): (v if v.dtype in (torch.int64, torch.bool) else v.float())
             for k, v in _tensors(folder).items()}
    fc = state.get("fc.weight")
    if fc is None or fc.shape[1] % spec.target_hidden_size:
        raise PairLoadError("the draft has no usable fc.weight: fix what `kimi-eagle doctor` refuses first")
    num_aux = fc.shape[1] // spec.target_hidden_size
    draft = Eagle3Draft(layer, num_aux, spec.target_hidden_size, spec.draft_vocab_size, fc_norm=spec.fc_norm,
                        norm_output=spec.norm_output)
    if "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    if "d2t" not in state:
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)
    try:
        draft.load_state_dict(state)
    except RuntimeError as exc:
        raise PairLoadError(f"the draft's tensors do not fit its config ({str(exc).splitlines()[0]}): fix what "
                            "`kimi-eagle doctor` refuses first") from None
    return draft.eval(), num_aux
