"""The CPU's paged attention kernels (csrc/paged_decode.c, csrc/paged_prefill.c), compiled for this machine on first
use into one library.

PyTorch has no paged attention for the CPU, so the SDPA backend gathers each decode sequence's K/V into a
contiguous copy and attends to the copy: K/V cross memory twice per step. The decode kernel reads them once, in
place, with an online softmax (what vLLM's CPU backend does with its own C++ kernels). The prefill kernel attends a
chunk's queries causally to the paged K/V in tiles of query rows, about 2.7x faster than PyTorch's CPU flash
attention on a 256-token prompt (benchmarks/prefill_attention.py). It is built with the machine's C
compiler (-O3 -march=native -fopenmp; TANDEM_CPU_ISA=avx2 targets an AVX2-only CPU instead, see isa.py) into a
cache directory keyed by the sources, the compiler, the flags and the CPU, and called through ctypes (which
releases the GIL). The kernels take 16-float vectors where the target has AVX-512 and 8-float ones elsewhere
(csrc/simd.h); `vector_width()` says which. Without a compiler, or with TANDEM_CPU_ATTENTION=sdpa, the SDPA
path runs instead; `load()` says why in `unavailable_reason()`.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from tandem.engine.attention.isa import IsaCap, isa_cap, march_flag

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
PREFILL_SOURCE = SOURCE.with_name("paged_prefill.c")
SOURCES = (SOURCE, PREFILL_SOURCE)
HEADERS = (SOURCE.with_name("simd.h"),)          # included by both sources: part of the cache key
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")
COMPILE_TIMEOUT_S = 120.0

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False
_limits: tuple[int, int, int] | None = None     # asked of the library once (supports() runs at every layer)
_prefill_limits: tuple[int, int, int] | None = None   # (max query heads per KV head, max head dim, max block size)


def _cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return Path(root) / "kernels"


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags (a shared cache may serve several machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))][:3]
    except OSError:
        keep = []
    return "\n".join([platform.machine(), platform.processor(), *keep])


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return cc
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def compile_flags(cap: IsaCap | None) -> tuple[str, ...]:
    """The compiler flags for a target: this machine's (-march=native) or a capped instruction set."""
    return (*BASE_FLAGS, march_flag(cap))


def build(cap: IsaCap | None) -> ctypes.CDLL:
    """Both kernels in one library compiled for `cap` (None: this machine), or the decode kernel alone if the
    prefill kernel does not compile here; RuntimeError without a working compiler."""
    cc, version = _toolchain()
    flags = compile_flags(cap)
    try:
        return bind(ctypes.CDLL(str(_compile(cc, version, SOURCES, flags))))
    except RuntimeError as e:
        log.warning("CPU paged prefill attention kernel unavailable (%s): prefill chunks use SDPA", e)
        return bind(ctypes.CDLL(str(_compile(cc, version, (SOURCE,), flags))))


def cache_key(sources: list[bytes], compiler_version: str, cpu: str, flags: tuple[str, ...]) -> str:
    """The compiled library's name in the cache: a hash of everything the machine code depends on."""
    return hashlib.sha256(b"\0".join([*sources, compiler_version.encode(), cpu.encode(),
                                       " ".join(flags).encode()])).hexdigest()[:16]


def compile_library(sources: tuple[Path, ...], flags: tuple[str, ...], stem: str) -> Path:
    """Another small C library (e.g. csrc/omp_bind.c) built and cached as the kernels are, named `stem`-KEY.so;
    RuntimeError without a working compiler."""
    return _compile(*_toolchain(), sources, flags, stem, headers=())


def _toolchain() -> tuple[str, str]:
    """The C compiler and its version text (part of every cache key); RuntimeError without one."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    return cc, subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def _compile(cc: str, version: str, sources: tuple[Path, ...], flags: tuple[str, ...], stem: str = "paged_attention",
             headers: tuple[Path, ...] = HEADERS) -> Path:
    """The cached shared library built from `sources` (compiled now when absent); RuntimeError if cc fails."""
    srcs = [p.read_bytes() for p in (*sources, *headers)]
    key = cache_key(srcs, version, _cpu_key(), flags)
    path = _cache_dir() / f"{stem}-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)                 # atomic: concurrent workers never load a half-written file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the compiled kernel's C signatures on a loaded library (also used by benchmarks on other builds)."""
    f = lib.tandem_paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    f.restype = None
    lib.tandem_paged_decode_limits.restype = ctypes.c_int
    if hasattr(lib, "tandem_simd_width"):
        lib.tandem_simd_width.restype = ctypes.c_int
    if hasattr(lib, "tandem_paged_prefill"):        # absent from a library built from paged_decode.c alone
        f = lib.tandem_paged_prefill
        f.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr,
                      ctypes.c_int]
        f.restype = None
        lib.tandem_paged_prefill_limits.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be used here (see `unavailable_reason`)."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("TANDEM_CPU_ATTENTION", "native").lower() in ("sdpa", "torch", "0", "off"):
                _why = "turned off by TANDEM_CPU_ATTENTION"
            else:
                try:
                    _lib = build(isa_cap())
                except Exception as e:  # noqa: BLE001 - any failure means: use the SDPA path, and say why once
                    _why = f"{type(e).__name__}: {e}"
                    log.warning("CPU paged decode attention kernel unavailable (%s): using the SDPA path", _why)
            _tried = True
    return _lib


def vector_width() -> int | None:
    """Floats per vector the loaded kernels were compiled with (16: AVX-512, 8: AVX2 or narrower); None if none."""
    lib = load()
    return lib.tandem_simd_width() if lib is not None and hasattr(lib, "tandem_simd_width") else None


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None if it loaded or was not tried)."""
    return _why


def limits() -> tuple[int, int, int] | None:
    """(max query heads, max head dim, max block size) the kernel takes, or None if unavailable."""
    global _limits
    if _limits is None:
        lib = load()
        if lib is None:
            return None
        _limits = _unpack(lib.tandem_paged_decode_limits())
    return _limits


def _unpack(v: int) -> tuple[int, int, int]:
    """A kernel's limits as its C function packs them: heads * 10^6 + head dim * 10^3 + block size."""
    return v // 1000000, (v // 1000) % 1000, v % 1000


def supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernel takes this step's tensors (CPU, float32, shapes within its limits)."""
    lim = limits()
    if lim is None or q.device.type != "cpu" or q.dtype != torch.float32 or kv.dtype != torch.float32:
        return False
    hq, hkv, d, bs = q.shape[1], kv.shape[3], kv.shape[4], kv.shape[2]
    return hq % hkv == 0 and hq <= lim[0] and d <= lim[1] and bs <= lim[2] and kv.is_contiguous()


def supports_prefill(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the prefill kernel takes this step's tensors: as `supports`, with the head dim and block size
    multiples of 16 (its vectors) within its limits."""
    global _prefill_limits
    if not supports(q, kv) or not hasattr(load(), "tandem_paged_prefill"):
        return False
    if _prefill_limits is None:
        _prefill_limits = _unpack(load().tandem_paged_prefill_limits())
    hq, hkv, d, bs = q.shape[1], kv.shape[3], kv.shape[4], kv.shape[2]
    g, lim = hq // hkv, _prefill_limits
    return g <= lim[0] and d <= lim[1] and bs <= lim[2] and d % 16 == 0 and bs % 16 == 0


def paged_prefill(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, starts: torch.Tensor,
                  qlens: torch.Tensor, seqs: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  out: torch.Tensor, lib: ctypes.CDLL | None = None) -> None:
    """out[starts[i] + t] = causal attention of q[starts[i] + t] (position seq_lens[i] - qlens[i] + t) over the first
    seq_lens[i] tokens of sequence seqs[i]'s blocks, for t < qlens[i].

    q/out [T, Hq, D] float32 contiguous, kv [2, blocks, block_size, Hkv, D] with the chunk's own K/V written,
    block_tables int32 [S, max_blocks], starts/qlens/seqs/seq_lens int64 [n]. The caller checks
    `supports_prefill` first. `lib`: another build of the kernels (`build`) instead of the loaded one."""
    lib = lib or load()
    assert lib is not None, "paged_prefill without the kernel: check supports_prefill() first"
    assert q.is_contiguous() and out.is_contiguous() and block_tables.dtype == torch.int32
    bt = block_tables.contiguous()
    lib.tandem_paged_prefill(q.data_ptr(), kv.data_ptr(), bt.data_ptr(), bt.shape[1], starts.data_ptr(),
                             qlens.data_ptr(), seqs.data_ptr(), seq_lens.data_ptr(), starts.numel(), kv.shape[1],
                             kv.shape[2], q.shape[1], kv.shape[3], kv.shape[4], float(scale), out.data_ptr(),
                             torch.get_num_threads())


def paged_decode(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
                 seqs: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                 lib: ctypes.CDLL | None = None) -> None:
    """out[rows[i]] = attention of q[rows[i]] over the first seq_lens[i] tokens of sequence seqs[i]'s blocks.

    q/out [T, Hq, D] float32 contiguous, kv [2, blocks, block_size, Hkv, D], block_tables int32 [S, max_blocks],
    rows/seqs/seq_lens int64 [n]. The caller checks `supports` first. `lib`: as in `paged_prefill`."""
    lib = lib or load()
    assert lib is not None, "paged_decode without the kernel: check supports() first"
    assert q.is_contiguous() and out.is_contiguous() and block_tables.dtype == torch.int32
    bt = block_tables.contiguous()
    lib.tandem_paged_decode(q.data_ptr(), kv.data_ptr(), bt.data_ptr(), bt.shape[1], rows.data_ptr(),
                            seqs.data_ptr(), seq_lens.data_ptr(), rows.numel(), kv.shape[1], kv.shape[2], q.shape[1],
                            kv.shape[3], kv.shape[4], float(scale), out.data_ptr(), torch.get_num_threads())
