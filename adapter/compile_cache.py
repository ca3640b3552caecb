"""Reuse of vLLM's saved torch.compile result, keyed by what the traced graph really captures.

vLLM 0.32 saves each model's AOT compile result under a hash of the config and loads it at the next start
(vllm/compilation/decorators.py). Two faults, one fix each, both guarded by version:

- On the CPU build every load fails: the saved `compiled_fn` is a plain function, and the loader calls its
  `finalize_loading(vllm_config)` ("'function' object has no attribute 'finalize_loading'"), so every start traces
  and compiles the model again. A plain function has nothing left to load.
- The key misses the aux hidden states the target captures for EAGLE-3, which are part of the traced graph:
  `SpeculativeConfig.compute_hash` adds only the draft config's top-level `eagle_aux_hidden_state_layer_ids`, so
  ids read from `eagle_config` (the SpecForge layout), vLLM's default ids, this plugin's alignment of the ids and
  its fault injection all reach the same key as another capture, and a start would run a graph traced for other
  layers, silently. The key gets the layers the model captures when it is compiled, wherever they came from.

Two savings besides:

- With an EAGLE-3 draft, vLLM's key for the target holds the whole draft (its path, its config), though the only
  part of it in the target's graph is the capture. So each new draft folder (a retrained draft, another layout, the
  random draft of `bench bypass`) traced the unchanged target again: 16-20 s a start for the tiny pair on one
  core (the suite's SpecForge copy, EAGLE-3.1 draft and random draft, 2026-12-05), and more the larger the target.
  A target that captures aux layers is keyed here by the config without the draft, plus the layers it captures;
  the draft's own graph, and every model under another speculative method (whose configs feed more into the
  target's graph), keep everything vLLM's key holds.
- vLLM gives each key an inductor cache of its own (`{key}/inductor_cache`), so a new key (another capture, another
  draft) compiled every kernel again. Inductor's caches are keyed by the graph's own content, so one of them can
  serve every key: each new key's `inductor_cache` becomes a link to `torch_compile_cache/inductor_shared` beside
  the keys. Measured on the tiny float32 pair: a copy of its draft started in 45 s instead of 85 s, the target's
  graph compiled in 17 s instead of 37 s.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_eagle.adapter import compat, surface

logger = logging.getLogger("vllm.kimi_eagle")  # under "vllm": its handlers and format


def _captured_layers(fn: Callable[..., Any]) -> tuple[int, ...] | None:
    """The aux layers the model behind a bound `forward` captures (DeepseekV2Model and the other EAGLE-3 targets
    keep them in `aux_hidden_state_layers`); None for a model that captures none (the draft)."""
    layers = getattr(getattr(fn, "__self__", None), "aux_hidden_state_layers", None)
    return None if layers is None else tuple(int(i) for i in layers)


def _eagle3(vllm_config: Any) -> Any:
    """The speculative config when it is EAGLE-3's, else None."""
    speculative = getattr(vllm_config, "speculative_config", None)
    return speculative if getattr(speculative, "method", None) == "eagle3" else None


def _keyed_by_captured_layers(model_hash_key: Callable[[Callable[..., Any]], str]) -> Callable[..., str]:
    """The model's part of the key: vLLM's, plus the layers a target captures; plus the EAGLE-3 config for every
    other model, whose config part (`_config_factors_without_the_draft`) no longer holds it."""
    def key(fn: Callable[..., Any]) -> str:
        upstream = model_hash_key(fn)
        layers = _captured_layers(fn)
        if layers:
            return hashlib.sha256(f"{upstream}|aux_hidden_state_layers={layers}".encode()).hexdigest()
        speculative = _eagle3(getattr(getattr(fn, "__self__", None), "vllm_config", None))
        if speculative is None:
            return upstream
        return hashlib.sha256(f"{upstream}|speculative_config={speculative.compute_hash()}".encode()).hexdigest()

    return key


def _config_factors_without_the_draft(hash_factors: Callable[[Any], list[str]]) -> Callable[[Any], list[str]]:
    """The config's part of the key, with an EAGLE-3 config left out: the model's part says what of it the graph
    holds (the captured layers for the target, the whole config for the draft)."""
    def factors(vllm_config: Any) -> list[str]:
        if _eagle3(vllm_config) is None:
            return hash_factors(vllm_config)
        without = copy.copy(vllm_config)  # a shallow copy: the engine's own config is not touched
        without.speculative_config = None
        return hash_factors(without)

    return factors


def _finalize_plain_functions(load_compiled_function: Callable[..., Any]) -> Callable[..., Any]:
    def load(*args: Any, **kwargs: Any) -> Any:
        loaded = load_compiled_function(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            compiled.finalize_loading = lambda vllm_config: None  # a plain function: nothing left to load
        return loaded

    return load


SHARED_INDUCTOR_CACHE = "inductor_shared"


def share_inductor_cache(key_dir: Path) -> bool:
    """Make `key_dir/inductor_cache`, while still empty, a link to the inductor cache shared by every key; True
    when it is one. Two engines compiling the same new key race here: the loser keeps what the winner made."""
    own = key_dir / "inductor_cache"
    shared = key_dir.parent.parent / SHARED_INDUCTOR_CACHE
    try:
        if not own.is_symlink() and own.is_dir() and not any(own.iterdir()):
            shared.mkdir(exist_ok=True)
            own.rmdir()
            # Relative to the link's folder: with a relative VLLM_CACHE_ROOT (`bench startup`'s default), a link
            # to `shared` as given dangles, and vLLM's next makedirs of the path fails the start.
            own.symlink_to(os.path.relpath(shared, own.parent), target_is_directory=True)
    except OSError as exc:
        logger.debug("kimi-eagle: %s keeps an inductor cache of its own: %s", key_dir.name, exc)
    return own.is_symlink()


def _sharing_the_inductor_cache(try_load: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM calls it with `{VLLM_CACHE_ROOT}/torch_compile_cache/torch_aot_compile/{key}/rank_R_D/model`, after it
    # made `{key}/inductor_cache` and pointed TORCHINDUCTOR_CACHE_DIR there, before it compiles anything.
    def load(model: Any, aot_compilation_path: str) -> Any:
        share_inductor_cache(Path(aot_compilation_path).parents[1])
        return try_load(model, aot_compilation_path)

    return load


def install() -> bool:
    """Key the cache by the captured layers (a target's not by the rest of its EAGLE-3 draft) and share inductor's
    cache between keys (any platform); on a CPU, let its saved results load."""
    if not compat.supported():
        return False
    from vllm.platforms import current_platform

    # The model's part first: were the config's part installed alone, a draft's key would no longer hold the draft.
    surface.wrap("vllm.compilation.decorators", "_model_hash_key", _keyed_by_captured_layers)
    surface.wrap("vllm.compilation.caching", "aot_compile_hash_factors", _config_factors_without_the_draft)
    surface.wrap("vllm.compilation.decorators", "_try_load_aot_compiled_fn", _sharing_the_inductor_cache)
    if current_platform.is_cpu():
        surface.wrap("torch.compiler", "load_compiled_function", _finalize_plain_functions)
    return True
