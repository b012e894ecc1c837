"""Instruction-set selection for the CPU attention kernels (engine/attention/isa.py, native.py) and the host record
of benchmarks (bench/host.py): which flags a cap compiles with, what the cache key covers, how a host is described."""
from __future__ import annotations

import pytest

from tandem.bench.host import Host, cpu_model, describe_host, isa_cap_env, parse_cpuinfo, widest_extension
from tandem.engine.attention.isa import ISA_ENV, IsaCap, isa_cap, march_flag, parse_isa_cap

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse4_1 sse4_2 avx f16c fma bmi2 avx2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse4_1 sse4_2 avx f16c fma bmi2 avx2 sha_ni
"""
XEON_AMX = """model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse4_2 avx fma avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8
"""
GRAVITON = """processor\t: 0
Features\t: fp asimd evtstrm aes sha1 sve
CPU part\t: 0xd40
"""


@pytest.mark.parametrize("text,want", [(None, None), ("", None), ("native", None), (" Native ", None),
                                       ("avx2", IsaCap.AVX2), ("AVX2", IsaCap.AVX2)])
def test_a_cap_is_parsed_from_its_name(text, want):
    """Protects the knob's spelling: empty or native means this machine, avx2 in any case means the AVX2 target."""
    assert parse_isa_cap(text) is want


def test_an_unknown_cap_is_a_one_line_error_naming_the_choices():
    """Protects bad input: an ISA the kernels have no target for is refused, naming the variable and the choices."""
    with pytest.raises(ValueError) as e:
        parse_isa_cap("avx512")
    assert str(e.value) == "TANDEM_CPU_ISA='avx512': unknown instruction set (one of: native, avx2)"


def test_the_cap_comes_from_the_environment():
    """Protects where the loader reads the cap: TANDEM_CPU_ISA, absent meaning this machine."""
    assert isa_cap({}) is None
    assert isa_cap({ISA_ENV: "avx2"}) is IsaCap.AVX2


def test_each_cap_compiles_for_its_own_target_and_has_its_own_cache_entry():
    """Protects the cap's effect: -march=native without one, -march=x86-64-v3 (AVX2 and FMA, no AVX-512) with avx2,
    the rest of the flags alike; the flags are part of the library's cache key, so the two builds never collide."""
    from tandem.engine.attention import native

    assert march_flag(None) == "-march=native" and march_flag(IsaCap.AVX2) == "-march=x86-64-v3"
    assert native.compile_flags(None) == (*native.BASE_FLAGS, "-march=native")
    assert native.compile_flags(IsaCap.AVX2) == (*native.BASE_FLAGS, "-march=x86-64-v3")
    src = [b"int f(void) { return 1; }"]
    keys = {native.cache_key(src, "gcc 13", "cpu", native.compile_flags(c)) for c in (None, IsaCap.AVX2)}
    assert len(keys) == 2
    assert native.cache_key(src, "gcc 13", "cpu", native.compile_flags(None)) == \
        native.cache_key(src, "gcc 13", "cpu", native.compile_flags(None))
    assert native.HEADERS[0].name == "simd.h" and native.HEADERS[0].is_file()


def test_an_avx2_only_host_is_described_by_its_model_and_extensions():
    """Protects the host record: the model name, the vector extensions in a fixed order, the widest one in words."""
    h = describe_host(cpuinfo=EPYC_AVX2)
    assert (h.cpu, h.vector_extensions, h.widest, h.emulated_cap, h.cap_env) == \
        ("AMD EPYC 7B12", ("sse4_2", "avx", "fma", "avx2"), "AVX2", None, {})
    assert h.kind() == "AVX2 native"
    assert h.line() == f"AMD EPYC 7B12 (AVX2: sse4_2 avx fma avx2), {h.cores} cores"


def test_an_emulated_cap_is_recorded_with_the_variables_that_made_it():
    """Protects honesty of emulated figures: the record says which host it ran on and which cap it emulated."""
    h = describe_host(IsaCap.AVX2, cpuinfo=XEON_AMX)
    assert h.widest == "AVX-512 + AMX" and h.emulated_cap == "avx2"
    assert h.kind() == "AVX2 emulated on an AVX-512 + AMX CPU"
    assert h.line().endswith(", emulating an AVX2-only host")
    assert h.cap_env == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                         "MKL_ENABLE_INSTRUCTIONS": "AVX2", "TANDEM_CPU_ISA": "avx2"}
    d = h.as_dict()
    assert d["kind"] == h.kind() and d["line"] == h.line() and d["vector_extensions"][-1] == "amx_int8"


def test_arm_features_count_as_flags():
    """Protects non-x86 hosts: ARM's Features line gives the extensions (NEON as asimd, SVE)."""
    name, flags = parse_cpuinfo(GRAVITON)
    assert name is None and {"asimd", "sve"} <= flags
    assert widest_extension(flags) == "SVE" and widest_extension({"asimd"}) == "NEON"
    assert widest_extension(set()) == "no AVX2"


def test_no_cap_sets_no_variables_and_the_short_model_line_names_the_widest():
    """Protects the native case and the one-line helper the chaos and determinism benchmarks print."""
    assert isa_cap_env(None) == {}
    h = describe_host()
    assert isinstance(h, Host) and cpu_model() == f"{h.cpu} ({h.widest})"


def test_vllms_feature_checks_report_no_avx512_under_the_benchmarks_avx2_cap():
    """Protects the vLLM side of engine_vs_vllm.py --isa avx2: with benchmarks/vllm_isa first on PYTHONPATH and
    TANDEM_VLLM_ISA=avx2, torch.cpu's AVX-512 and AMX checks (which vLLM reads to pick _C_AVX2 and its attention
    variant) say False in a fresh interpreter; without the variable they are untouched."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    site = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_isa"
    code = ("import torch; c = torch.cpu; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), "
            "c._is_amx_tile_supported(), c.get_capabilities().get('avx512_f', False))")
    capped = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(site),
                                                                "TANDEM_VLLM_ISA": "avx2"},
                            capture_output=True, text=True, check=True)
    raw = torch.cpu.get_capabilities().get("avx512_f", False)
    assert capped.stdout.split() == ["False", "False", "False", str(raw)]
    assert torch.cpu._is_avx512_supported() == raw    # this interpreter (no sitecustomize) is untouched
