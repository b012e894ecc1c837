"""Which CPUs each OpenMP thread of a CPU engine is bound to (vLLM's VLLM_CPU_OMP_THREADS_BIND): the option's text
parsed, and the CPUs of every tensor-parallel rank (and every worker of a live server) decided and checked against
the CPUs the process may use. Pure (no I/O): the caller passes the allowed set; the engine, its tensor-parallel ranks
and the live server all decide here, and tandem.engine.omp_affinity carries the decision out.

Values: None or "nobind" (the default: threads left to the OS scheduler), "auto" (rank r of a group whose ranks run
N threads each takes the allowed set's CPUs r*N .. r*N+N-1, in ascending order), or CPU lists such as "0-3" or
"0,2,4,6", one per rank separated by "|" ("0-1|2-3" for two ranks). A list sets its rank's thread count to its
length, as in vLLM.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.knob import KnobError

NOBIND = "nobind"
AUTO = "auto"
OPTION = "cpu_omp_threads_bind"
MAX_CPUS = 1024                  # glibc's CPU_SETSIZE: the CPUs a cpu_set_t (csrc/omp_bind.c) can name


class CpuBindError(ValueError):
    """A binding that cannot be parsed or applied here; the message is one line naming the option."""


class BindMode(enum.Enum):
    """How the option binds: not at all, the first CPUs of the allowed set, or explicit lists."""

    NOBIND = NOBIND
    AUTO = AUTO
    LISTS = "lists"


@dataclass(frozen=True)
class CpuBind:
    """A parsed cpu_omp_threads_bind value; `lists`: one CPU list per rank (mode LISTS only)."""

    mode: BindMode = BindMode.NOBIND
    lists: tuple[tuple[int, ...], ...] = ()

    @property
    def on(self) -> bool:
        """Whether any thread is bound."""
        return self.mode is not BindMode.NOBIND


def format_cpus(cpus: Iterable[int]) -> str:
    """CPUs as a compact list, runs as ranges: (0, 1, 2, 5) -> "0-2,5" (order kept)."""
    out: list[str] = []
    run: list[int] = []
    for c in cpus:
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [c]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """One rank's CPUs: "0-3", "0,2,4,6", "0-1,4" (CpuBindError on an empty, malformed or repeating list)."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not (lo.strip().isdigit() and (not dash or hi.strip().isdigit())):
            raise CpuBindError(f"{OPTION}: {text.strip()!r} is not a CPU list such as 0-3 or 0,2,4,6")
        a, b = int(lo), int(hi) if dash else int(lo)
        if b < a:
            raise CpuBindError(f"{OPTION}: range {part!r} runs backwards")
        if b >= MAX_CPUS:
            raise CpuBindError(f"{OPTION}: CPU {b} is past the {MAX_CPUS} CPUs a CPU set can name")
        cpus.extend(range(a, b + 1))
    seen: set[int] = set()
    for c in cpus:
        if c in seen:
            raise CpuBindError(f"{OPTION}: CPU {c} is listed twice in {text.strip()!r}")
        seen.add(c)
    return tuple(cpus)


def parse_cpu_bind(text: str | None) -> CpuBind:
    """The option's value parsed (CpuBindError, one line, on a bad one)."""
    if text is None:
        return CpuBind()
    if not isinstance(text, str):
        raise CpuBindError(f"{OPTION} must be auto, nobind or CPU lists such as 0-3, got {text!r}")
    t = text.strip()
    if not t:
        raise CpuBindError(f"{OPTION} must be auto, nobind or CPU lists such as 0-3, got an empty value")
    if t.lower() == NOBIND:
        return CpuBind()
    if t.lower() == AUTO:
        return CpuBind(BindMode.AUTO)
    return CpuBind(BindMode.LISTS, tuple(parse_cpu_list(part) for part in t.split("|")))


def cpu_bind_text(text: str) -> str:
    """The knob's parser: the text, checked (KnobError naming what was expected)."""
    try:
        parse_cpu_bind(text)
    except CpuBindError as e:
        raise KnobError(str(e).removeprefix(f"{OPTION}: ")) from None
    return text.strip()


def rank_threads(bind: CpuBind, rank: int, default: int) -> int:
    """The OpenMP threads of rank `rank`: its list's length under explicit lists, else `default`."""
    if bind.mode is BindMode.LISTS and rank < len(bind.lists):
        return len(bind.lists[rank])
    return default


def plan_ranks(bind: CpuBind, allowed: Iterable[int], threads: int, size: int = 1,
               first: int = 0) -> tuple[tuple[int, ...], ...] | None:
    """Each rank's CPUs (rank 0 first), or None when nothing is bound; `threads` is each rank's thread count under
    auto, `first` how many allowed CPUs auto skips (taken by earlier workers). CpuBindError (one line) unless every
    CPU is one the process may use, every rank has at least one, and no two ranks share one."""
    if not bind.on:
        return None
    ok = sorted(set(allowed))
    if bind.mode is BindMode.AUTO:
        if threads < 1:
            raise CpuBindError(f"{OPTION} auto: the thread count must be >= 1, got {threads}")
        need = first + threads * size
        if need > len(ok):
            ranks = f"{size} ranks x {threads} threads" if size > 1 else f"{threads} threads"
            before = f" after the {first} taken by other workers" if first else ""
            raise CpuBindError(f"{OPTION} auto: {ranks} need {threads * size} CPUs{before}, but this process may use "
                               f"{len(ok)} ({format_cpus(ok)})")
        return tuple(tuple(ok[first + r * threads:first + (r + 1) * threads]) for r in range(size))
    lists = bind.lists
    if len(lists) != size:
        raise CpuBindError(f"{OPTION}: {size} tensor-parallel rank(s) need {size} CPU list(s) separated by '|', "
                           f"got {len(lists)}")
    allowed_set = set(ok)
    seen: dict[int, int] = {}
    for r, cpus in enumerate(lists):
        bad = [c for c in cpus if c not in allowed_set]
        if bad:
            raise CpuBindError(f"{OPTION}: CPU {bad[0]} is not one this process may use ({format_cpus(ok)})")
        for c in cpus:
            if c in seen:
                raise CpuBindError(f"{OPTION}: ranks {seen[c]} and {r} both list CPU {c}")
            seen[c] = r
    return lists


def plan_workers(bind: CpuBind, allowed: Iterable[int], threads: int, tps: Sequence[int]) -> list[str | None]:
    """A live server's workers (tensor-parallel degrees `tps`, in worker order), each given its own explicit value of
    the option: under auto, consecutive slices of `threads` CPUs per rank, worker after worker, so no two workers
    share a CPU; explicit lists are one worker's and apply to a single worker. None per worker when nothing is bound."""
    if not bind.on:
        return [None] * len(tps)
    allowed = sorted(set(allowed))
    if bind.mode is BindMode.LISTS:
        if len(tps) != 1:
            raise CpuBindError(f"{OPTION}: explicit CPU lists bind one worker's ranks; with {len(tps)} workers use "
                               f"auto (each worker then gets CPUs of its own)")
        return ["|".join(format_cpus(c) for c in plan_ranks(bind, allowed, threads, tps[0]) or ())]
    need = threads * sum(tps)
    if len(tps) > 1 and need > len(allowed):
        raise CpuBindError(f"{OPTION} auto: {len(tps)} workers of {sum(tps)} rank(s) in all x {threads} thread(s) "
                           f"need {need} CPUs, but this process may use {len(allowed)} ({format_cpus(allowed)})")
    out: list[str | None] = []
    first = 0
    for tp in tps:
        out.append("|".join(format_cpus(c) for c in plan_ranks(bind, allowed, threads, tp, first) or ()))
        first += threads * tp
    return out
