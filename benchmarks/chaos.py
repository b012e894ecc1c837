"""The standing chaos suite: every known attack on a live `tandem serve`, replayed, with expected against observed.

    python benchmarks/chaos.py [--out docs/results/chaos] [--only known,http_body,...]

Each module of `tandem.bench.chaos` lists its probes (`PROBES`); every probe starts the servers it needs on
127.0.0.1 (a tiny random Qwen3 checkpoint made once in a temporary directory, and the committed tiny SDAR model for
the diffusion probe), attacks them in a bounded way and returns one row per check. The table goes to stdout and to
OUT/table.md; the exit status is 1 when any row fails. About 3 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tandem.bench.chaos import ChaosContext, Outcome
from tandem.bench.chaos.lifecycle import make_model
from tandem.bench.host import cpu_model

MODULES = ("known", "http_body", "zmq_inbox", "lifecycle", "diffusion")
SDAR = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"


def run(modules: list[str], workdir: Path) -> list[tuple[str, Outcome, float]]:
    """Every probe of `modules`: (module, outcome, seconds the probe took) per row; a probe that raises is a failed
    row saying why."""
    ctx = ChaosContext(workdir, make_model(workdir / "tiny-qwen3"), SDAR if SDAR.is_dir() else None)
    probes = [(m, p) for m in modules for p in importlib.import_module(f"tandem.bench.chaos.{m}").PROBES]
    rows: list[tuple[str, Outcome, float]] = []
    with Progress(transient=True) as prog:
        task = prog.add_task("chaos probes", total=len(probes))
        for mod, probe in probes:
            t0 = time.monotonic()
            try:
                outs = probe(ctx)
            except Exception as e:  # noqa: BLE001 - a probe that breaks is a failed row, not a crashed suite
                last = traceback.extract_tb(e.__traceback__)[-1]
                outs = [Outcome(probe.__name__, "runs to the end", f"{type(e).__name__}: {e} ({last.name})", False)]
            took = time.monotonic() - t0
            rows += [(mod, o, took) for o in outs]
            prog.advance(task)
    return rows


def table_md(rows: list[tuple[str, Outcome, float]]) -> str:
    lines = ["| module | attack | expected | observed | pass |", "|---|---|---|---|---|"]
    for mod, o, _ in rows:
        cells = [mod, o.attack, o.expected, o.observed, "pass" if o.passed else "**FAIL**"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/chaos", help="where table.md goes")
    ap.add_argument("--only", default=",".join(MODULES), help=f"modules to run, comma-separated ({', '.join(MODULES)})")
    a = ap.parse_args(argv)
    modules = [m for m in a.only.split(",") if m]
    unknown = sorted(set(modules) - set(MODULES))
    if unknown or not modules:
        ap.error(f"--only takes modules among {', '.join(MODULES)}; got {', '.join(unknown) or 'none'}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-chaos-") as tmp:
        rows = run(modules, Path(tmp))
    took = time.monotonic() - t0
    table = Table(title="chaos suite: expected against observed")
    for col in ("module", "attack", "expected", "observed", "pass"):
        table.add_column(col, overflow="fold")
    for mod, o, _ in rows:
        table.add_row(mod, o.attack, o.expected, o.observed, "pass" if o.passed else "[red]FAIL[/red]")
    Console().print(table)
    failed = sum(not o.passed for _, o, _ in rows)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    footer = (f"\n{len(rows) - failed} of {len(rows)} rows pass; {took:.0f} s on {cpu_model()}, "
              f"{stamp}.\n")
    print(footer.strip())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table_md(rows) + footer)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
