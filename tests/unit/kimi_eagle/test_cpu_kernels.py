"""Which of vLLM's CPU kernel builds runs here, on every x86 ISA vLLM supports: natively on this machine's CPU, and
on an AVX2-only AMD EPYC (Zen 3) emulated by qemu-user, where `import vllm._C` is an illegal instruction."""

from __future__ import annotations

import ast
import json
import platform
import shutil
import subprocess
import sys

import pytest

from kimi_eagle import cpu_kernels
from kimi_eagle.cpu_kernels import CpuIsa, expected_build, kernel_report, load_vllm_kernels, this_cpu
from tests.helpers.cli import REPO

# QEMU's model of an AMD EPYC Zen 3: AVX2, no AVX-512 (TCG, qemu's emulator, implements no AVX-512 at all).
AVX2_ONLY_CPU = "EPYC-Milan"
CODE_FOLDERS = ("adapter", "bench", "doctor", "fixtures", "kimi_eagle", "loadtest", "serve", "tests")


def _isa(avx512: bool = False, bf16: bool = False, amx: bool = False) -> CpuIsa:
    return CpuIsa(model="test", avx2=True, avx512=avx512, avx512_bf16=bf16, amx=amx)


@pytest.mark.skipif(not cpu_kernels.X86, reason="three kernel builds on x86 only")
@pytest.mark.parametrize(("isa", "build", "name"), [
    (_isa(), "_C_AVX2", "AVX2"),  # AMD EPYC Zen 3
    (_isa(avx512=True), "_C_AVX512", "AVX-512"),  # Intel Skylake-SP, Cascade Lake
    (_isa(avx512=True, bf16=True), "_C", "AVX-512 + BF16"),  # AMD EPYC Zen 4 and later
    (_isa(avx512=True, bf16=True, amx=True), "_C", "AVX-512 + BF16 + AMX"),  # Intel Sapphire Rapids and later
], ids=["avx2", "avx512", "avx512-bf16", "amx"])
def test_each_isa_gets_the_build_vllm_loads_for_it(isa: CpuIsa, build: str, name: str) -> None:
    assert expected_build(isa) == build
    assert isa.name == name
    assert cpu_kernels.mla_backend(isa) == ("AMX_MLA" if isa.amx else "CPU_MLA")


def test_other_architectures_have_one_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "X86", False)
    assert {expected_build(_isa()), expected_build(_isa(avx512=True))} == {"_C"}


def test_vllm_loads_the_build_this_cpu_calls_for() -> None:
    isa = this_cpu()
    loaded = load_vllm_kernels()
    assert loaded == expected_build(isa), f"on {isa.model} ({isa.name}) vLLM loaded {loaded}"
    report = kernel_report()
    assert report.loaded and report.kernel_build == loaded and report.isa == isa.name
    assert f"vLLM CPU kernels {loaded} (built for {report.built_for}; loaded)" in report.line()


def _imports_of_a_kernel_build(tree: ast.AST) -> list[str]:
    """`import vllm._C`, `from vllm import _C_AVX2`, `import_module("vllm._C")`, `torch.ops.load_library(...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("vllm._C")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("vllm._C"):
                found.append(node.module)
            elif node.module == "vllm":
                found += [f"vllm.{a.name}" for a in node.names if a.name.startswith("_C")]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name == "load_library" or (name == "import_module" and any(
                    isinstance(a, ast.Constant) and str(a.value).startswith("vllm._C") for a in node.args)):
                found.append(ast.unparse(node))
    return found


def test_no_code_imports_a_kernel_build_by_name() -> None:
    """vLLM picks the build this CPU can run (`current_platform.import_kernels`, `cpu_kernels.load_vllm_kernels`);
    a build imported by name ends the process with SIGILL on a CPU without its ISA."""
    offenders = {}
    for folder in CODE_FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            found = _imports_of_a_kernel_build(ast.parse(path.read_text(), str(path)))
            if found:
                offenders[str(path.relative_to(REPO))] = found
    assert not offenders, f"kernel builds imported by name: {offenders}"
    assert _imports_of_a_kernel_build(ast.parse("import vllm._C\nfrom vllm import _C_AVX2"))  # the check sees them


@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86 CPU on an x86 host")
def test_on_an_avx2_only_cpu_vllm_loads_its_avx2_build_and_the_cpu_fixes_hold() -> None:
    """The AVX2 build runs upstream's expand (still losing its output: the fault is the same on every ISA), our fix,
    and CPU_MLA's decode kernel on our verification rows, on an emulated Zen 3. `make test` installs qemu-user
    (Debian's package) where it can."""
    if not this_cpu().avx512:
        pytest.skip("this CPU is AVX2-only: the whole suite runs vLLM's _C_AVX2 build natively")
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.skip("qemu-user is not installed (Debian: apt-get install qemu-user; `make test` does it as root): "
                    "the AVX2-only CPU is not emulated")
    done = subprocess.run([qemu, "-cpu", AVX2_ONLY_CPU, sys.executable, "-m", "tests.helpers.kernel_probe"],
                          cwd=REPO, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, f"exit {done.returncode} on an emulated {AVX2_ONLY_CPU}: {done.stderr[-3000:]}"
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["isa"] == "AVX2", probe  # the emulation hides AVX-512, else nothing here is tested
    assert probe["loaded_build"] == probe["expected_build"] == "_C_AVX2", probe
    assert probe["upstream_expand"] == [-123.0] * 6, probe  # why the fix exists, on this build too
    assert probe["fixed_expand"] == pytest.approx([0.8, 0.8, 0.7, 0.7, 0.7, 1.0]), probe
    assert probe["mla_decode_error"] < 1e-4, probe
