"""A pytest plugin for vLLM's own tests, run in a child process of tests/upstream/test_vllm_own_tests.py: what a
CPU worker of vLLM does before its first step, so that the tests meet the code serving runs.

vLLM's CPU worker loads the general plugins (kimi-eagle's among them, when it is installed and wanted) and then
registers its C++ stand-ins for the Triton kernels (`CpuPlatform.register_triton_kernel_overrides`); the fixes that
replace a stand-in must come first, as in the worker. `KIMI_EAGLE_UPSTREAM_FIXES=1` loads the plugin, anything else
runs vLLM alone.
"""

from __future__ import annotations

import os

FIXES = "KIMI_EAGLE_UPSTREAM_FIXES"


def pytest_configure(config) -> None:
    from vllm.platforms import current_platform

    if os.environ.get(FIXES) == "1":
        from kimi_eagle.adapter import plugin

        plugin.register()
    current_platform.register_triton_kernel_overrides()
