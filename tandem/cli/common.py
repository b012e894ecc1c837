"""What every `tandem` subcommand shares: the usage error, the parser class, argument types, queued notes,
output-path checks and the --workload loader (generators, public traces, session files).

The lowest module of tandem.cli: it imports no other cli module (`make lint` checks it).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tandem import knob
from tandem.workload.options import DEFAULT_RATE, DEFAULT_SESSIONS
from tandem.workload.session import SLO, WorkloadError

PROG = "tandem"


class CLIError(Exception):
    """A command-line usage error; its message is printed as `tandem: error: <message>`."""


class Parser(argparse.ArgumentParser):
    """argparse that raises CLIError instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise CLIError(message)


# --------------------------------------------------------------------------- notes

_NOTES: list[str] = []


def note(message: str) -> None:
    """Queue a note for stderr; notes are printed once validation passed, so an error stays one line."""
    _NOTES.append(message)


def flush_notes() -> None:
    """Print the queued notes on stderr (`tandem: note: ...`) and forget them."""
    for message in _NOTES:
        print(f"{PROG}: note: {message}", file=sys.stderr)
    _NOTES.clear()


def clear_notes() -> None:
    """Forget the queued notes (a new command line starts)."""
    _NOTES.clear()


def percent(x: float | None) -> str:
    """A share as a percentage with one decimal ("-" for None): 0.4567 -> '45.7%'."""
    return "-" if x is None else f"{100 * x:.1f}%"


# --------------------------------------------------------------------------- progress


class StderrBar:
    """A transient rich progress bar on stderr (description, bar, done/total, `extra` columns, elapsed time); inert
    when not enabled."""

    def __init__(self, enabled: bool, description: str = "{task.description}", *extra: str) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                                *(TextColumn(c) for c in extra), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.start()

    def close(self) -> None:
        """Stop drawing (the bar is transient: it leaves nothing behind)."""
        if self.bar is not None:
            self.bar.stop()


class SessionBar(StderrBar):
    """A progress bar of completed sessions, one line per tracked run."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(enabled, "{task.description}", "{task.fields[failed]} failed")

    def track(self, label: str, total: int):
        """A new line of `total` sessions; returns the callback that advances it by one finished session record."""
        if self.bar is None:
            return None
        task = self.bar.add_task(label, total=total, failed=0)
        failed = [0]

        def done(rec) -> None:
            failed[0] += bool(rec.failed)
            self.bar.update(task, advance=1, failed=failed[0])
        return done


# --------------------------------------------------------------------------- argument types


positive_float = knob.argparse_type(knob.positive_float)
nonneg_float = knob.argparse_type(knob.nonneg_float)
positive_int = knob.argparse_type(knob.positive_int)
seed_arg = knob.argparse_type(knob.seed)
byte_size = knob.argparse_type(knob.byte_size)


def csv_list(item_type: Callable[[str], Any]) -> Callable[[str], list]:
    """An argument type: a comma-separated list of `item_type` values."""
    return knob.argparse_type(knob.csv_list(item_type))


def check_preemption(mode: str | None, swap_space: float | None) -> None:
    """--preemption-mode swap with no swap space is refused before anything starts."""
    if mode == "swap" and swap_space == 0:
        raise CLIError("--preemption-mode swap needs --swap-space > 0")


def require_ray(flag: str) -> None:
    """CLIError naming the extra when Ray is not installed (`flag` is the option that asked for it)."""
    from tandem.runtime.ray_launcher import RayUnavailable, import_ray
    try:
        import_ray(flag)
    except RayUnavailable as e:
        raise CLIError(str(e)) from None


@contextlib.contextmanager
def ray_executor(args) -> Iterator[Any]:
    """The tandem.bench.ray_pool.RayExecutor of --ray (None without it), disconnected at the end."""
    if not args.ray:
        if args.ray_address:
            raise CLIError("--ray-address applies to --ray")
        yield None
        return
    require_ray("--ray")
    from tandem.bench.ray_pool import RayExecutor
    from tandem.runtime.ray_launcher import RayLaunchError
    try:
        executor = RayExecutor.connect(args.ray_address)
    except RayLaunchError as e:
        raise CLIError(str(e)) from None
    try:
        yield executor
    finally:
        executor.close()


def check_out_path(path: str | None) -> None:
    """Fail before any work when an output file cannot be written there (a directory, a missing folder)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(21, "Is a directory", path)
    if not p.parent.is_dir():
        raise FileNotFoundError(2, "No such directory", str(p.parent))


# --------------------------------------------------------------------------- workloads


def load_workload(args, model: str) -> tuple[list, float | None, str]:
    """Sessions for --workload, the arrival rate applied (None: the trace's own), and the workload kind.

    Reads args.workload, rate, sessions, seed, override_arrivals, slo_ttft, slo_itl and (optional)
    prefill_basis; shared by `simulate`, `generate`, `plan` and `bench`.
    """
    from tandem.workload import generators, traces
    from tandem.workload.arrivals import with_arrivals
    from tandem.workload.session import load_sessions

    names = generators.GENERATOR_NAMES
    basis = getattr(args, "prefill_basis", None)
    if basis is not None and args.workload not in generators.WORKLOADS:
        note(f"--prefill-basis only applies to the AMPD generators ({', '.join(generators.WORKLOADS)}); ignored")
        basis = None
    if args.workload in names:
        if args.override_arrivals:
            note("--override-arrivals only applies to traces; generated sessions always use --rate")
        rate = args.rate if args.rate is not None else DEFAULT_RATE
        slo = slo_from_args(args, generators.default_slo(model, args.workload))
        sessions = generators.generate(args.workload, args.sessions or DEFAULT_SESSIONS, rate, args.seed, slo=slo,
                                       prefill_basis=basis)
        return sessions, rate, "generator"
    if args.workload in traces.TRACE_FILES:
        sessions = traces.load_trace(args.workload, limit=args.sessions)
    elif Path(args.workload).suffix in (".jsonl", ".json", ".ndjson") or Path(args.workload).exists():
        sessions = load_sessions(args.workload)
        if args.sessions is not None:
            sessions = sessions[: args.sessions]
    else:
        raise WorkloadError(f"unknown workload {args.workload!r}: not a generator ({', '.join(names)}), "
                            f"a public trace ({', '.join(traces.TRACE_FILES)}) or a .jsonl file")
    rate = None
    if args.override_arrivals:
        rate = args.rate if args.rate is not None else DEFAULT_RATE
        sessions = with_arrivals(sessions, rate, args.seed)
    elif args.rate is not None:
        note(f"--rate {args.rate:g} is ignored: the trace keeps its own arrival times (add --override-arrivals)")
    slo = slo_from_args(args, None)
    if slo is not None:
        sessions = [dataclasses.replace(s, slo=slo) for s in sessions]
    return sessions, rate, "trace"


def slo_from_args(args, default: SLO | None) -> SLO | None:
    """--slo-ttft/--slo-itl over `default`; one flag alone completes `default` or is an error."""
    if args.slo_ttft is None and args.slo_itl is None:
        return default
    if default is None and (args.slo_ttft is None or args.slo_itl is None):
        raise CLIError("give both --slo-ttft and --slo-itl (this workload has no default SLO)")
    return SLO(args.slo_ttft if args.slo_ttft is not None else default.ttft_s,
               args.slo_itl if args.slo_itl is not None else default.itl_s)


def cost_fields(args) -> dict:
    """The SimConfig fields of the cost flags (absent flags keep SimConfig's defaults)."""
    from tandem.sim.config import COST_KNOBS

    return {k: getattr(args, k) for k in COST_KNOBS if getattr(args, k, None) is not None}


def cost_note(gpu: str, args) -> None:
    """Resolve the cost flags once: a one-line CLIError when measured costs are asked for and missing, a note when
    auto falls back to the roofline."""
    from tandem.perf.costs import choose_cost_model
    from tandem.perf.measured.source import MissingCostData

    try:
        choice = choose_cost_model(args.cost_model, gpu, args.cost_framework)
    except (MissingCostData, ValueError) as e:
        raise CLIError(str(e)) from None
    if choice.note:
        note(choice.note)
