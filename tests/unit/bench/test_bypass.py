"""`bench --bypass`'s random draft: the profile's draft in shape, nothing of it in its matrices."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from kimi_eagle.bench.bypass import random_draft
from kimi_eagle.fixtures.pair_spec import DRAFT_DIR


def test_the_random_draft_keeps_shapes_scale_maps_and_config_and_redraws_every_matrix(tmp_path: Path) -> None:
    out = random_draft(DRAFT_DIR, tmp_path / "random")
    assert (out / "config.json").read_text() == (DRAFT_DIR / "config.json").read_text()
    trained, random = load_file(DRAFT_DIR / "model.safetensors"), load_file(out / "model.safetensors")
    assert trained.keys() == random.keys()
    for name, t in trained.items():
        r = random[name]
        assert r.shape == t.shape and r.dtype == t.dtype, name
        if t.ndim == 2 and t.is_floating_point():
            assert not torch.equal(r, t), name
            assert abs(r.float().std() / t.float().std() - 1) < 0.1, name
        else:  # norms, d2t / t2d
            assert torch.equal(r, t), name
