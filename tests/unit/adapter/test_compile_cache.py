"""The compile cache's key sees the aux layers the target captures; upstream's does not. A target's key holds its
capture, not the rest of its EAGLE-3 draft; the draft's key holds the draft. Every key compiles into one inductor
cache."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from kimi_eagle.adapter import compile_cache


class Target(torch.nn.Module):
    """What the key reads of a model: its bound `forward`, the aux layers it captures (if any), its config."""

    def __init__(self, layers: tuple[int, ...] | None, vllm_config: object = None) -> None:
        super().__init__()
        if layers is not None:
            self.aux_hidden_state_layers = layers
        self.vllm_config = vllm_config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _upstream_key():
    from vllm.compilation import decorators

    return getattr(decorators._model_hash_key, "upstream", decorators._model_hash_key)


def test_upstream_key_is_blind_to_the_captured_layers_and_ours_is_not() -> None:
    upstream = _upstream_key()
    three, one = Target((2, 4, 6)).forward, Target((6,)).forward
    assert upstream(three) == upstream(one)  # vLLM 0.32: a graph traced for (2, 4, 6) would serve (6,)
    ours = compile_cache._keyed_by_captured_layers(upstream)
    assert ours(three) != ours(one)
    assert ours(three) == ours(Target((2, 4, 6)).forward)  # the same capture finds its saved graph
    assert ours(Target(None).forward) == upstream(Target(None).forward)  # a draft captures nothing: vLLM's own key


def _config(draft: str | None, method: str = "eagle3", rest: str = "the target and the rest") -> SimpleNamespace:
    """A config as the key reads it: vLLM hashes the speculative config with the rest (its draft's path and config
    included); `_config_hash` stands for `VllmConfig.compute_hash`."""
    speculative = None if draft is None else SimpleNamespace(method=method, compute_hash=lambda: f"{method}:{draft}")
    return SimpleNamespace(speculative_config=speculative, rest=rest)


def _config_hash(vllm_config: SimpleNamespace) -> list[str]:
    speculative = vllm_config.speculative_config
    return [vllm_config.rest, "None" if speculative is None else speculative.compute_hash()]


def _key(vllm_config: SimpleNamespace, model: torch.nn.Module) -> str:
    """As vLLM makes the key of a compiled model (vllm/compilation/decorators.py), with the plugin's two parts."""
    factors = compile_cache._config_factors_without_the_draft(_config_hash)(vllm_config)
    factors.append(compile_cache._keyed_by_captured_layers(_upstream_key())(model.forward))
    return hashlib.sha256(str(factors).encode()).hexdigest()


def test_a_targets_key_holds_its_capture_not_its_draft() -> None:
    """A new draft folder (retrained, another layout, the random draft of `bench bypass`) reuses the target's
    graph; a draft's own graph, a target alone and another method keep keys of their own."""
    draft_a, draft_b = _config("drafts/a"), _config("drafts/b")
    assert _key(draft_a, Target((2, 4, 6), draft_a)) == _key(draft_b, Target((2, 4, 6), draft_b))
    assert _key(draft_a, Target((2, 4, 6), draft_a)) != _key(draft_a, Target((6,), draft_a))
    assert _key(draft_a, Target((2, 4, 6), draft_a)) != _key(_config("drafts/a", rest="another target"),
                                                               Target((2, 4, 6), draft_a))
    # The draft captures nothing: its key holds the whole speculative config, as vLLM's does.
    assert _key(draft_a, Target((), draft_a)) != _key(draft_b, Target((), draft_b))
    assert _key(draft_a, Target(None, draft_a)) != _key(draft_b, Target(None, draft_b))
    alone = _config(None)
    assert _key(alone, Target(None, alone)) == hashlib.sha256(
        str([*_config_hash(alone), _upstream_key()(Target(None, alone).forward)]).encode()).hexdigest()
    assert _key(alone, Target(None, alone)) != _key(draft_a, Target((2, 4, 6), draft_a))
    # Other methods feed more of their config into the target's graph (vLLM hashes them so): vLLM's key.
    mtp_a, mtp_b = _config("drafts/a", method="mtp"), _config("drafts/b", method="mtp")
    assert compile_cache._config_factors_without_the_draft(_config_hash)(mtp_a) == _config_hash(mtp_a)
    assert _key(mtp_a, Target((2, 4, 6), mtp_a)) != _key(mtp_b, Target((2, 4, 6), mtp_b))
    assert draft_a.speculative_config is not None, "the engine's own config is left as it was"


def test_install_wraps_the_key_and_the_cpu_loader_once() -> None:
    from vllm.compilation import caching, decorators

    from kimi_eagle.adapter.surface import ORIGINAL

    assert compile_cache.install() and compile_cache.install()
    for wrapped in (decorators._model_hash_key, caching.aot_compile_hash_factors,
                    torch.compiler.load_compiled_function, decorators._try_load_aot_compiled_fn):
        assert hasattr(wrapped, ORIGINAL)
        assert not hasattr(getattr(wrapped, ORIGINAL), ORIGINAL)  # wrapped once


def _new_key(root, key: str):
    """What vLLM makes for a key before it compiles: `{key}/inductor_cache`, empty."""
    key_dir = root / "torch_compile_cache" / "torch_aot_compile" / key
    (key_dir / "inductor_cache").mkdir(parents=True)
    return key_dir


def test_every_new_key_compiles_into_one_shared_inductor_cache(tmp_path) -> None:
    shared = tmp_path / "torch_compile_cache" / compile_cache.SHARED_INDUCTOR_CACHE
    first, second = _new_key(tmp_path, "a" * 64), _new_key(tmp_path, "b" * 64)
    assert compile_cache.share_inductor_cache(first) and compile_cache.share_inductor_cache(second)
    (first / "inductor_cache" / "kernel.so").write_text("compiled once")
    assert (second / "inductor_cache" / "kernel.so").read_text() == "compiled once", "the second key sees it"
    assert (shared / "kernel.so").is_file()
    assert compile_cache.share_inductor_cache(first), "a key already linked (the engine that lost a race) stays so"


def test_a_key_that_compiled_into_a_cache_of_its_own_keeps_it(tmp_path) -> None:
    older = _new_key(tmp_path, "c" * 64)
    (older / "inductor_cache" / "kernel.so").write_text("from before the plugin shared")
    assert not compile_cache.share_inductor_cache(older)
    assert (older / "inductor_cache" / "kernel.so").read_text() == "from before the plugin shared"


def test_the_link_holds_under_a_relative_cache_root(tmp_path, monkeypatch) -> None:
    """`bench startup` gives each round a cache root under its relative --out: the link must resolve from there."""
    monkeypatch.chdir(tmp_path)
    key = _new_key(Path("results") / "vllm-cache", "d" * 64)
    assert compile_cache.share_inductor_cache(key)
    assert (key / "inductor_cache").resolve() == (tmp_path / "results" / "vllm-cache" / "torch_compile_cache"
                                                  / compile_cache.SHARED_INDUCTOR_CACHE)
    os.makedirs(key / "inductor_cache", exist_ok=True)  # what vLLM does with it at each compile
