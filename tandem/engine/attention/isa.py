"""Which instruction set tandem's C attention kernels are compiled for: the machine's own (-march=native), or a cap.

The kernels pick their vector width when compiled, from the target's features (16 floats with AVX-512, 8 with
AVX2 only: csrc/simd.h). TANDEM_CPU_ISA=avx2 compiles them as for an AVX2-only x86 CPU (-march=x86-64-v3, which
has AVX2 and FMA but no AVX-512) on any x86-64 machine, so the AVX2 variant can be run and measured on an AVX-512
host; the compiled library's cache key includes the flags.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum

ISA_ENV = "TANDEM_CPU_ISA"


class IsaCap(str, Enum):
    """An instruction-set cap for the CPU kernels (and, in benchmarks, for torch, oneDNN and MKL)."""

    AVX2 = "avx2"


# the compiler's target per cap; None = this machine
_MARCH = {None: "-march=native", IsaCap.AVX2: "-march=x86-64-v3"}


def parse_isa_cap(text: str | None) -> IsaCap | None:
    """`text` as a cap: None, "" or "native" for none; ValueError (one line) for anything unknown."""
    value = (text or "").strip().lower()
    if value in ("", "native"):
        return None
    try:
        return IsaCap(value)
    except ValueError:
        known = ", ".join(["native", *(c.value for c in IsaCap)])
        raise ValueError(f"{ISA_ENV}={text!r}: unknown instruction set (one of: {known})") from None


def isa_cap(env: Mapping[str, str] | None = None) -> IsaCap | None:
    """The cap TANDEM_CPU_ISA asks for (None: compile for this machine)."""
    return parse_isa_cap((os.environ if env is None else env).get(ISA_ENV))


def march_flag(cap: IsaCap | None) -> str:
    """The compiler's -march flag for a cap."""
    return _MARCH[cap]
