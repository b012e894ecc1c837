"""What a `tandem` command costs before it does anything: its imports and the wall time of `tandem CMD --help`, and
the whole `tandem plan` command, against a baseline revision.

Both trees are copied without bytecode (`git archive` of --base, the package of this checkout) into a temporary
folder and run with PYTHONDONTWRITEBYTECODE=1, so every process compiles the tandem modules it imports (the
libraries keep their installed bytecode); `--bytecode compiled` compiles both copies first. Runs alternate old and
new on one CPU (--cpu). Per command: the median wall seconds of `tandem CMD --help`, and in a separate run (the
measurement slows the imports) `-X importtime`'s total (every module's own import time summed) and the part of it
tandem's modules started (the cumulative times of its top-level tandem entries: no interpreter start-up). With
--plan also the whole `tandem plan` command of plan_speed.py's CLI_ARGS with --jobs 1: with --no-cache (median wall
and CPU seconds, and its imports' total) and from a warm run cache (the same command again: median wall seconds),
and whether old and new print the same plan (`--json`, all but the wall-time field). Writes cli_startup.json, .md
and .png to --out.

    python benchmarks/cli_startup.py [--base REV] [--commands plan,simulate,serve] [--repeat 5] [--cpu 0] [--plan]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN_ARGS = ("plan", "--gpus", "256", "--workload", "toolbench", "--rate", "16", "--slo-ttft", "1.0", "--slo-itl",
             "0.05", "--jobs", "1", "--no-progress")
WALL_FIELDS = ("plan_wall_s",)
_IMPORT = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)")


def _copy_trees(base: str, dest: Path) -> dict[str, Path]:
    """`old`: the package at revision `base`; `new`: this checkout's package as it is on disk; neither with bytecode."""
    old, new = dest / "old", dest / "new"
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", base, "tandem"], capture_output=True, check=True).stdout
    old.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(old, filter="data")
    shutil.copytree(ROOT / "tandem", new / "tandem", ignore=shutil.ignore_patterns("__pycache__"))
    return {"old": old, "new": new}


def _run(tree: Path, argv: tuple[str, ...], cpu: int | None, importtime: bool = False,
         cwd: Path | None = None) -> tuple[float, float, str, str]:
    """Wall seconds, CPU seconds (user + system), stdout and stderr of `python -m tandem.cli ARGV` on `tree`."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "tandem.cli", *argv]
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", COLUMNS="120")
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=pin, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, used, p.stdout, p.stderr


def import_total_ms(stderr: str) -> float:
    """The sum of every module's own import time in `-X importtime` output, in milliseconds."""
    return sum(int(m.group(1)) for m in map(_IMPORT.match, stderr.splitlines()) if m) / 1000


def import_tandem_ms(stderr: str) -> float:
    """The milliseconds of the imports tandem's modules started: the cumulative times of the top-level tandem entries
    of `-X importtime` output (Python's own start-up, site and encodings, left out)."""
    return sum(int(m.group(2)) for m in map(_IMPORT.match, stderr.splitlines())
               if m and not m.group(3) and m.group(4).startswith("tandem")) / 1000


def _same_plan(a: str, b: str) -> bool:
    """Whether two `--json` plans agree in everything but their wall times."""
    def strip(text: str) -> list:
        return [{k: v for k, v in row.items() if k not in WALL_FIELDS} for row in json.loads(text)]
    return strip(a) == strip(b)


def measure(trees: dict[str, Path], commands: list[str], repeat: int, cpu: int | None, plan: bool,
            cwd: Path) -> dict:
    """Alternate old and new `repeat` times for each measurement; medians and every sample."""
    samples: dict[str, dict[str, list[float]]] = {}

    def add(key: str, version: str, value: float) -> None:
        samples.setdefault(key, {"old": [], "new": []})[version].append(value)

    for cmd in commands:
        for _ in range(repeat):
            for version in ("old", "new"):
                add(f"{cmd} --help wall s", version, _run(trees[version], (cmd, "--help"), cpu, cwd=cwd)[0])
                err = _run(trees[version], (cmd, "--help"), cpu, importtime=True, cwd=cwd)[3]
                add(f"{cmd} --help imports ms", version, import_total_ms(err))
                add(f"{cmd} --help tandem imports ms", version, import_tandem_ms(err))
    same = None
    if plan:
        cold = (*PLAN_ARGS, "--no-cache")
        warm = {v: (*PLAN_ARGS, "--cache-dir", str(cwd / f"cache-{v}")) for v in trees}   # a key holds the source
        for version in ("old", "new"):
            _run(trees[version], warm[version], cpu, cwd=cwd)                              # fills the run cache
        for _ in range(repeat):
            for version in ("old", "new"):
                wall, used, _, _ = _run(trees[version], cold, cpu, cwd=cwd)
                add("plan command wall s", version, wall)
                add("plan command CPU s", version, used)
                err = _run(trees[version], cold, cpu, importtime=True, cwd=cwd)[3]
                add("plan command imports ms", version, import_total_ms(err))
                add("plan command, warm run cache, wall s", version, _run(trees[version], warm[version], cpu,
                                                                          cwd=cwd)[0])
        outs = {v: _run(trees[v], (*cold, "--json"), cpu, cwd=cwd)[2] for v in ("old", "new")}
        same = _same_plan(outs["old"], outs["new"])
    rows = []
    for key, by in samples.items():
        old, new = statistics.median(by["old"]), statistics.median(by["new"])
        rows.append({"what": key, "old": old, "new": new, "change": new - old, "ratio": new / old if old else None,
                     "old_samples": by["old"], "new_samples": by["new"]})
    return {"rows": rows, "same_plan": same, "repeat": repeat, "cpu": cpu}


def markdown(res: dict, meta: dict) -> str:
    lines = [f"`tandem` start-up, {meta['base']} (old) against {meta['head']} (new): median of {res['repeat']} "
             f"alternating runs{'' if res['cpu'] is None else ' on CPU ' + str(res['cpu'])}, "
             + ("tandem compiled beforehand" if meta["bytecode"] == "compiled" else "no cached tandem bytecode"), "",
             "| what | old | new | new - old | new / old |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        unit = "ms" if r["what"].endswith("ms") else "s"
        fmt = (lambda x: f"{x:.1f}") if unit == "ms" else (lambda x: f"{x:.3f}")
        lines.append(f"| {r['what']} | {fmt(r['old'])} | {fmt(r['new'])} | {fmt(r['change'])} | {r['ratio']:.3f} |")
    if res["same_plan"] is not None:
        lines += ["", f"same plan (`--json`, wall times aside): {'yes' if res['same_plan'] else 'NO'}"]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """Old against new for each measurement, as a share of old: the median a bar, every sample a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.5))
    for i, r in enumerate(rows):
        for j, version in enumerate(("old", "new")):
            vals = [v / r["old"] for v in r[f"{version}_samples"]]
            y = i * 3 + j
            ax.barh(y, statistics.median(vals), color=("#999999", "#1f77b4")[j], label=version if i == 0 else None)
            ax.scatter(vals, [y] * len(vals), s=8, color="black", zorder=3)
        ax.text(0.02, i * 3 + 1, f"{r['new'] / r['old']:.2f}", va="center", fontsize=7, color="white")
    ax.set_yticks([i * 3 + 0.5 for i in range(len(rows))], [r["what"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("share of old (bar: median of the runs, dots: each run)")
    ax.set_title("tandem start-up and `tandem plan`: old against new", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="74f00a2", help="the baseline revision (default: %(default)s)")
    ap.add_argument("--commands", default="plan,simulate,serve", help="commands whose --help is timed")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU every run is pinned to (-1: none)")
    ap.add_argument("--plan", action="store_true", help="also time the whole `tandem plan` command")
    ap.add_argument("--bytecode", choices=("source", "compiled"), default="source")
    ap.add_argument("--out", default="docs/results/cli_startup")
    args = ap.parse_args()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="cli-startup-") as tmp:
        trees = _copy_trees(args.base, Path(tmp))
        if args.bytecode == "compiled":
            for tree in trees.values():
                subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "tandem")], check=True)
        cwd = Path(tmp) / "cwd"
        cwd.mkdir()
        res = measure(trees, [c for c in args.commands.split(",") if c], args.repeat,
                      None if args.cpu < 0 else args.cpu, args.plan, cwd)
    meta = {"base": args.base, "head": head, "bytecode": args.bytecode, "python": sys.version.split()[0]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli_startup.json").write_text(json.dumps({**meta, **res}, indent=2) + "\n")
    (out / "cli_startup.md").write_text(markdown(res, meta))
    plot(res, out / "cli_startup.png")
    print(markdown(res, meta), end="")


if __name__ == "__main__":
    main()
