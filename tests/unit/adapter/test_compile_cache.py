"""The compile cache's key sees the aux layers the target captures; upstream's does not."""

from __future__ import annotations

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
