"""The compile cache's key sees the aux layers the target captures; upstream's does not. Every key compiles into
one inductor cache."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kimi_eagle.adapter import compile_cache


class Target(torch.nn.Module):
    """What the key reads of a model: its bound `forward`, and the aux layers it captures (if any)."""

    def __init__(self, layers: tuple[int, ...] | None) -> None:
        super().__init__()
        if layers is not None:
            self.aux_hidden_state_layers = layers

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


def test_install_wraps_the_key_and_the_cpu_loader_once() -> None:
    from vllm.compilation import decorators

    assert compile_cache.install() and compile_cache.install()
    assert decorators._model_hash_key.kimi_eagle_wrapped
    assert not getattr(decorators._model_hash_key.upstream, "kimi_eagle_wrapped", False)  # wrapped once
    assert torch.compiler.load_compiled_function.kimi_eagle_wrapped
    assert decorators._try_load_aot_compiled_fn.kimi_eagle_wrapped


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
    """`bench --startup` gives each round a cache root under its relative --out: the link must resolve from there."""
    monkeypatch.chdir(tmp_path)
    key = _new_key(Path("results") / "vllm-cache", "d" * 64)
    assert compile_cache.share_inductor_cache(key)
    assert (key / "inductor_cache").resolve() == (tmp_path / "results" / "vllm-cache" / "torch_compile_cache"
                                                  / compile_cache.SHARED_INDUCTOR_CACHE)
    os.makedirs(key / "inductor_cache", exist_ok=True)  # what vLLM does with it at each compile
