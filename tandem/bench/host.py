"""What kind of host a benchmark ran on: the CPU model, its vector extensions and any emulated ISA cap.

Every benchmark report that compares CPU figures records this, so a figure measured on an AVX-512 Xeon is never
read as one from an AVX2-only EPYC. An ISA cap (`isa_cap_env`) makes the libraries of this process tree behave as
on an older CPU: torch's ATen kernels (ATEN_CPU_CAPABILITY), oneDNN's JIT (ONEDNN_MAX_CPU_ISA), MKL's dispatch
(MKL_ENABLE_INSTRUCTIONS) and tandem's C attention kernels (TANDEM_CPU_ISA). It is an emulation: the caches,
the clock and the memory system stay this machine's.
"""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.engine.attention.isa import ISA_ENV, IsaCap

# vector extensions worth recording, widest last (as /proc/cpuinfo spells them)
VECTOR_FLAGS = ("sse4_2", "avx", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")

# per cap: the environment that makes torch, oneDNN, MKL and tandem's kernels stop at that ISA
_CAP_ENV = {
    IsaCap.AVX2: {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                  ISA_ENV: IsaCap.AVX2.value},
}


@dataclass(frozen=True)
class Host:
    """One host's description for a report."""

    cpu: str
    cores: int
    arch: str
    vector_extensions: tuple[str, ...]
    widest: str                       # "AVX-512", "AVX2", "NEON", ... (the machine's, not the cap's)
    emulated_cap: str | None = None   # e.g. "avx2": the libraries were capped to it (see isa_cap_env)
    cap_env: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """One line for a table header: "Intel Xeon (AVX-512: avx2 avx512f ...), 2 cores, emulating AVX2"."""
        text = f"{self.cpu} ({self.widest}: {' '.join(self.vector_extensions) or 'no vector extensions'}), " \
               f"{self.cores} cores"
        return text + (f", emulating an {self.emulated_cap.upper()}-only host" if self.emulated_cap else "")

    def kind(self) -> str:
        """The host kind in a few words: "AVX-512 native" or "AVX2 emulated on an AVX-512 CPU"."""
        if self.emulated_cap:
            return f"{self.emulated_cap.upper()} emulated on an {self.widest} CPU"
        return f"{self.widest} native"

    def as_dict(self) -> dict:
        """JSON-ready fields, with `line` and `kind` included."""
        return {**asdict(self), "vector_extensions": list(self.vector_extensions), "line": self.line(),
                "kind": self.kind()}


def parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """(model name, flag set) of the first processor in a /proc/cpuinfo text (ARM's "Features" counts as flags)."""
    name, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if name is None and key in ("model name", "Model name"):
            name = value.strip()
        elif not flags and key in ("flags", "Features"):
            flags = set(value.split())
    return name, flags


def widest_extension(flags: set[str]) -> str:
    """The widest vector ISA in a flag set, in words."""
    if "amx_tile" in flags:
        return "AVX-512 + AMX"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    if "sve" in flags:
        return "SVE"
    if "asimd" in flags:
        return "NEON"
    return "no AVX2"


def describe_host(cap: IsaCap | None = None, cpuinfo: str | None = None) -> Host:
    """This machine (or the given /proc/cpuinfo text), with the cap the run was emulating, if any."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    name, flags = parse_cpuinfo(cpuinfo)
    return Host(cpu=name or platform.processor() or platform.machine() or "unknown CPU", cores=os.cpu_count() or 1,
                arch=platform.machine(), vector_extensions=tuple(f for f in VECTOR_FLAGS if f in flags),
                widest=widest_extension(flags), emulated_cap=cap.value if cap else None,
                cap_env=dict(isa_cap_env(cap)) if cap else {})


def cpu_model() -> str:
    """The CPU model and its widest vector extension, e.g. "Intel(R) Xeon(R) Processor (AVX-512 + AMX)"."""
    h = describe_host()
    return f"{h.cpu} ({h.widest})"


def isa_cap_env(cap: IsaCap | None) -> dict[str, str]:
    """The environment variables that cap torch, oneDNN, MKL and tandem's kernels at `cap` ({} for none)."""
    return {} if cap is None else dict(_CAP_ENV[cap])
