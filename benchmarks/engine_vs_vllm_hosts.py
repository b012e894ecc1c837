"""engine_vs_vllm.py's offline results side by side per host kind (AVX-512 native, AVX2 emulated, ...), with tandem
before and after an engine change: one table and one plot.

    python benchmarks/engine_vs_vllm_hosts.py AFTER_DIR[:BEFORE_DIR] ... [--out docs/results/engine_vs_vllm]

Each AFTER_DIR / BEFORE_DIR holds a results.json of `engine_vs_vllm.py --skip-online` (BEFORE_DIR: the same
command with --tandem-rev at the older tree). The host kind of each row is read from the results' host record
(tandem/bench/host.py), never assumed. Writes hosts.md and engine_vs_vllm_hosts.png under --out and prints the
table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(d: str) -> dict:
    p = Path(d) / "results.json"
    if not p.is_file():
        raise SystemExit(f"engine_vs_vllm_hosts.py: error: {p} does not exist")
    return json.loads(p.read_text())


def _med(cell: dict, system: str, key: str = "tokens_per_s") -> float | None:
    return ((cell.get(system) or {}).get(key) or {}).get("median")


def _bound(res: dict) -> str:
    """How tandem's threads were bound in a results set: by the engine's cpu_omp_threads_bind, by libgomp's
    GOMP_CPU_AFFINITY (results from before the engine had the option), or not at all ("")."""
    if res.get("tandem_cpu_omp_threads_bind"):
        return f", tandem's threads bound by the engine (cpu_omp_threads_bind {res['tandem_cpu_omp_threads_bind']})"
    return ", tandem's threads bound (GOMP_CPU_AFFINITY)" if res.get("tandem_threads_bound") else ""


def rows(sets: list[tuple[dict, dict | None]]) -> list[dict]:
    """One row per (host kind, threads): tandem before/after, vLLM, the ratios, identical outputs."""
    out = []
    for after, before in sets:
        kind = after["machine"].get("kind", "unknown host") + _bound(after)
        for t, cell in after["offline"].items():
            bcell = (before or {}).get("offline", {}).get(t, {})
            out.append({
                "kind": kind, "threads": t, "commit": after["commit"],
                "tandem": _med(cell, "tandem"), "vllm": _med(cell, "vllm"), "ratio": cell.get("ratio"),
                "cpu_ratio": cell.get("cpu_ratio"),
                "tandem_range": [(cell["tandem"]["tokens_per_s"] or {}).get(k) for k in ("min", "max")],
                "vllm_range": [(cell["vllm"]["tokens_per_s"] or {}).get(k) for k in ("min", "max")],
                "identical": (cell.get("outputs") or {}).get("identical"), "of": (cell.get("outputs") or {}).get("of"),
                "before_tandem": _med(bcell, "tandem"), "before_vllm": _med(bcell, "vllm"),
                "before_ratio": bcell.get("ratio"), "before_commit": (before or {}).get("commit"),
                "before_identical": (bcell.get("outputs") or {}).get("identical"),
                "runs": after.get("runs"), "before_runs": (before or {}).get("runs"), "date": after.get("date")})
    return out


def _f(x, fmt=".0f") -> str:
    return "-" if x is None else format(x, fmt)


def table(rs: list[dict]) -> str:
    lines = ["| host kind | threads | tandem tok/s (median, min-max) | vLLM tok/s | **tandem / vLLM** | per CPU-second | "
             "identical greedy outputs | tandem before: tok/s, / vLLM (same run) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rs:
        before = "-" if r["before_tandem"] is None else \
            f"{_f(r['before_tandem'])}, {_f(r['before_ratio'], '.2f')}x ({r['before_identical']}/{r['of']} identical)"
        lines.append(f"| {r['kind']} | {r['threads']} | {_f(r['tandem'])} ({_f(r['tandem_range'][0])}-"
                     f"{_f(r['tandem_range'][1])}) | {_f(r['vllm'])} ({_f(r['vllm_range'][0])}-{_f(r['vllm_range'][1])}) | "
                     f"**{_f(r['ratio'], '.2f')}x** | {_f(r['cpu_ratio'], '.2f')}x | {r['identical']}/{r['of']} | {before} |")
    return "\n".join(lines)


def _short(kind: str) -> str:
    """A host kind for an axis label: "AVX2 emulated" for "AVX2 emulated on an AVX-512 + AMX CPU", the binding on a
    line of its own, shortened ("bound by the engine", "bound (GOMP)")."""
    head, _, bound = kind.partition(", ")
    head = head.split(" on an ")[0]
    if "by the engine" in bound:
        bound = "bound by the engine"
    elif "GOMP" in bound:
        bound = "bound (GOMP)"
    return head + (f"\n{bound}" if bound else "")


def plot(rs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(rs)), 4.2))
    w = 0.27
    bars = (("before_tandem", "tandem before", "lightsteelblue"), ("tandem", "tandem", "tab:blue"),
            ("vllm", "vLLM CPU", "tab:orange"))
    for j, (key, label, color) in enumerate(bars):
        xs = [i + (j - 1) * w for i in range(len(rs))]
        vals = [r[key] or 0 for r in rs]
        ax.bar(xs, vals, w, color=color, label=label)
        for x, v in zip(xs, vals):
            if v:
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    for i, r in enumerate(rs):
        ax.text(i, max(r["tandem"] or 0, r["vllm"] or 0, r["before_tandem"] or 0) * 1.12 + 10,
                f"{_f(r['ratio'], '.2f')}x", ha="center", fontsize=9, fontweight="bold")
    ax.set_xticks(range(len(rs)))
    ax.set_xticklabels([f"{_short(r['kind'])}\n{r['threads']} thread{'s' if r['threads'] != '1' else ''}" for r in rs],
                       fontsize=8)
    ax.set_ylabel("offline output tokens/s (median)")
    ax.margins(y=0.2)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("tandem vs vLLM CPU per host kind, offline\n(tandem / vLLM above each group; "
                 "the AVX2 groups are emulated on an AVX-512 CPU)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sets", nargs="+", metavar="AFTER_DIR[:BEFORE_DIR]")
    ap.add_argument("--out", default="docs/results/engine_vs_vllm")
    a = ap.parse_args(argv)
    sets = []
    for s in a.sets:
        after, _, before = s.partition(":")
        sets.append((_load(after), _load(before) if before else None))
    rs = rows(sets)
    md = table(rs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts.md").write_text(md + "\n")
    plot(rs, out / "engine_vs_vllm_hosts.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
