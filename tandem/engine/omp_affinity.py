"""Binding a CPU engine's OpenMP threads to CPUs, one thread per CPU, as tandem.engine.cpu_bind decided (vLLM's
CPU worker does the same for VLLM_CPU_OMP_THREADS_BIND).

torch's CPU build runs its intra-op parallelism on libgomp, and tandem's C kernels share that one libgomp: a small C
function (csrc/omp_bind.c, compiled and cached as the attention kernels are) opens one parallel region of n threads
in which thread i binds itself to cpus[i]. libgomp keeps those threads for every later region started from the same
thread, so torch's operators and the kernels run on the bound team. The pool belongs to the thread that starts the
regions: a process whose steps run on another thread (a live worker's step thread) binds again from that thread.
Without a C compiler every thread of the process is confined to the CPUs instead (logged once).
"""
from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from tandem.engine.attention import native
from tandem.engine.config import EngineError
from tandem.engine.cpu_bind import CpuBindError, format_cpus, parse_cpu_bind, plan_ranks
from tandem.engine.parallel.group import default_rank_threads

if TYPE_CHECKING:
    import torch

    from tandem.engine.config import EngineConfig

log = logging.getLogger(__name__)
SOURCE = Path(native.__file__).with_name("csrc") / "omp_bind.c"
FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False
_allowed: tuple[int, ...] | None = None
_fallback_logged = False


class BindHow(enum.Enum):
    """How the threads were bound: each OpenMP thread to its own CPU, or (no compiler) the whole process to the set."""

    OPENMP = "openmp"
    PROCESS = "process"


@dataclass(frozen=True)
class Binding:
    """What was bound: thread i of the OpenMP team to cpus[i] (OPENMP), or every thread to all of cpus (PROCESS)."""

    cpus: tuple[int, ...]
    how: BindHow

    def describe(self) -> str:
        """One line for the startup log and stats."""
        if self.how is BindHow.OPENMP:
            return f"{len(self.cpus)} OpenMP thread(s) bound one per CPU to {format_cpus(self.cpus)}"
        return f"process confined to CPUs {format_cpus(self.cpus)} (no per-thread binding: {_why})"


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may use, as first read here (a binding later narrows the calling thread's own mask)."""
    global _allowed
    if _allowed is None:
        _allowed = tuple(sorted(os.sched_getaffinity(0)))
    return _allowed


def library() -> ctypes.CDLL | None:
    """The compiled omp_bind library, or None without a working compiler (`unavailable_reason` says why)."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                lib = ctypes.CDLL(str(native.compile_library((SOURCE,), FLAGS, "omp_bind")))
                p = ctypes.POINTER(ctypes.c_int)
                lib.tandem_omp_bind.argtypes = [p, ctypes.c_int, p]
                lib.tandem_omp_bind.restype = ctypes.c_int
                lib.tandem_omp_team.argtypes = [ctypes.c_int, p]
                lib.tandem_omp_team.restype = ctypes.c_int
                _lib = lib
            except Exception as e:  # noqa: BLE001 - any failure means: bind the process instead, and say why
                _why = f"{type(e).__name__}: {e}"
            _tried = True
    return _lib


def unavailable_reason() -> str | None:
    """Why `library()` returned None (None if it loaded or was not tried)."""
    return _why


def bind_threads(cpus: Sequence[int]) -> Binding:
    """torch's threads set to len(cpus) and thread i of the calling thread's OpenMP team bound to cpus[i]; without
    the library, every thread of the process confined to cpus (logged once)."""
    global _fallback_logged, _why
    import torch
    cpus = tuple(int(c) for c in cpus)
    n = len(cpus)
    torch.set_num_threads(n)
    lib = library()
    if lib is not None:
        rc = lib.tandem_omp_bind((ctypes.c_int * n)(*cpus), n, None)
        if rc == 0:
            binding = Binding(cpus, BindHow.OPENMP)
            log.info("%s", binding.describe())
            return binding
        _why = "the OpenMP team was smaller than asked" if rc < 0 else f"sched_setaffinity failed on {rc} thread(s)"
    for tid in _tasks():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:              # a thread that ended meanwhile
            pass
    binding = Binding(cpus, BindHow.PROCESS)
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("%s", binding.describe())
    return binding


def _tasks() -> list[int]:
    """This process's threads' kernel ids."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:                  # pragma: no cover - no /proc: the calling thread alone
        return [0]


def team_thread_ids(n: int) -> list[int]:
    """The kernel thread ids of a parallel region of n threads started from the calling thread (tests read each
    one's affinity); [] without the library."""
    lib = library()
    if lib is None:
        return []
    tids = (ctypes.c_int * n)()
    team = lib.tandem_omp_team(n, tids)
    return list(tids[:team])


def engine_plan(cfg: EngineConfig, device: torch.device) -> tuple[tuple[int, ...], ...] | None:
    """Each rank's CPUs under the config's cpu_omp_threads_bind (rank 0 the driver), checked against the CPUs this
    process may use before any rank starts (EngineError, one line); None when nothing is bound or the engine is not
    on the CPU. Auto gives each rank torch's thread count (one rank), or the group's share of the CPUs."""
    bind = parse_cpu_bind(cfg.cpu_omp_threads_bind)
    if not bind.on:
        return None
    if device.type != "cpu":
        log.info("cpu_omp_threads_bind applies to CPU engines: ignored on %s", device)
        return None
    import torch
    size = cfg.tensor_parallel_size
    threads = torch.get_num_threads() if size == 1 else default_rank_threads(size)
    try:
        return plan_ranks(bind, allowed_cpus(), threads, size)
    except CpuBindError as e:
        raise EngineError(str(e)) from None


def spread_calling_thread(binding: Binding) -> None:
    """The calling thread (bound to the team's first CPU) allowed on all of the binding's CPUs again: for a thread
    that hands its steps to another one, which then binds its own team."""
    os.sched_setaffinity(0, binding.cpus)
