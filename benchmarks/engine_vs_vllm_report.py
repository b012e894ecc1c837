"""engine_vs_vllm.py's report: one thread count's offline runs summarised into a cell (medians, the ratios, the
greedy outputs compared), the offline and online tables, table.md's text, the console tables and the plot. Reads only
the results dict, so results.json written by an older run reports the same."""
from __future__ import annotations

import statistics
from pathlib import Path

SYSTEMS = ("tandem", "vllm")


def compare_outputs(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    first = None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            first = {"request": i, "position": pos}
            break
    mism = [next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            for x, y in zip(a, b) if x != y]
    return {"identical": same, "of": len(a), "first_mismatch": first,
            "earliest_mismatch_position": min(mism) if mism else None}

def offline_cell(runs: dict[str, list[dict]], expect_tokens: int) -> dict:
    """One thread count's cell from each system's runs (their token_ids taken out): tokens/s and per CPU-second
    min/median/max, medians of startup and memory, the greedy outputs compared, the ratios of the medians."""
    cell: dict = {}
    for s in SYSTEMS:
        rs = runs[s]
        if not rs:
            cell[s] = {"error": "every run failed"}
            continue
        toks = [r.pop("token_ids") for r in rs]
        cpu = [r["tokens_per_cpu_s"] for r in rs if r.get("tokens_per_cpu_s")]
        cell[s] = {"tokens_per_s": _stats([r["tokens_per_s"] for r in rs]),
                   "tokens_per_cpu_s": _stats(cpu) if len(cpu) == len(rs) else None,
                   "startup_s": statistics.median(r["startup_s"] for r in rs),
                   "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in rs),
                   "peak_pss_bytes": statistics.median(r["peak_pss_bytes"] for r in rs),
                   "runs": rs, "all_output_tokens": all(r["output_tokens"] == expect_tokens for r in rs),
                   "runs_identical_outputs": all(x == toks[0] for x in toks), "_tokens": toks[0]}
    if all("_tokens" in cell[s] for s in SYSTEMS):
        cell["outputs"] = compare_outputs(cell["tandem"]["_tokens"], cell["vllm"]["_tokens"])
        cell["ratio"] = cell["tandem"]["tokens_per_s"]["median"] / cell["vllm"]["tokens_per_s"]["median"]
        if cell["tandem"]["tokens_per_cpu_s"] and cell["vllm"]["tokens_per_cpu_s"]:
            cell["cpu_ratio"] = (cell["tandem"]["tokens_per_cpu_s"]["median"]
                                 / cell["vllm"]["tokens_per_cpu_s"]["median"])
    for s in SYSTEMS:
        cell[s].pop("_tokens", None)
    return cell


def ran_at_summary(res: dict) -> str:
    """What each system's runs reported they ran at, in one line (the first offline run of each)."""
    parts = []
    for s in SYSTEMS:
        seen = next((r.get("ran_at") for cell in (res.get("offline") or {}).values()
                     for r in (cell.get(s) or {}).get("runs", []) if r.get("ran_at")), None)
        if seen:
            parts.append(f"{s}: " + ", ".join(f"{k} {v}" for k, v in seen.items() if k != "caps" and v is not None))
    return "; ".join(parts)


def markdown(res: dict, off_md: str, on_md: str) -> str:
    """table.md: the host and versions, what ran at which ISA, the tables with their workloads, the failures."""
    wl, ol = res["offline_workload"], res["online_workload"]
    head = (f"{res['model']}; host: {res['machine']['line']}; {res['date']}; commit {res['commit']}; "
            f"vLLM {res['versions']['vllm']} (CPU), torch {res['versions']['tandem_torch']}\n")
    if res.get("tandem_threads_bound"):
        how = res.get("tandem_cpu_omp_threads_bind") or "auto"
        head += (f"\ntandem's OpenMP threads bound one per core by the engine (cpu_omp_threads_bind {how}"
                 f"{': cores 0..N-1' if how == 'auto' else ''}), as vLLM binds its own.\n")
    ran_at = ran_at_summary(res)
    if ran_at:
        head += f"\nRan at: {ran_at}\n"
    md = head
    if res["offline"]:
        md += (f"\nOffline, {wl['requests']} requests, prompts {wl['min_prompt']}-{wl['max_prompt']} tokens, "
               f"{wl['output_len']} output tokens, greedy, {res['runs']} alternating runs per system:\n\n{off_md}\n")
    if res["online"]:
        md += (f"\nOnline, 1 compute thread, {ol['requests']} Poisson requests per rate, {ol['prompt_len']} prompt / "
               f"{ol['output_len']} output tokens, streamed /v1/completions, {res['online_runs']} alternating runs "
               f"per system (medians of the runs' figures):\n\n{on_md}\n")
    if res["failures"]:
        md += "\nFailures:\n" + "\n".join(f"- {f}" for f in res["failures"]) + "\n"
    return md


def write(res: dict, out: Path, console) -> None:
    """table.md and engine_vs_vllm.png under out, and the tables on the console (rich)."""
    from rich.table import Table
    off_md, on_md = tables(res)
    (out / "table.md").write_text(markdown(res, off_md, on_md))
    plot(res, out / "engine_vs_vllm.png")
    ran_at = ran_at_summary(res)
    console.print(f"host: {res['machine']['line']}" + (f"\nran at: {ran_at}" if ran_at else ""))
    for title, body in (("offline", off_md if res["offline"] else ""), ("online", on_md if res["online"] else "")):
        if not body:
            continue
        rows = [ln.strip("|").split("|") for ln in body.splitlines()]
        table = Table(title=title)
        for h in rows[0]:
            table.add_column(h.strip())
        for r in rows[2:]:
            table.add_row(*[c.strip() for c in r])
        console.print(table)


def _stats(xs: list[float]) -> dict:
    """min, median and max of xs ({} for none)."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else {}


def gib(b) -> str:
    """Bytes as GiB with two decimals ("-" for none)."""
    return f"{b / 2**30:.2f}" if b else "-"


def fmt(x, spec: str = ".0f") -> str:
    """A number formatted ("-" for None)."""
    return "-" if x is None else format(x, spec)


def tables(res: dict) -> tuple[str, str]:
    """The offline and online tables (markdown)."""
    off_lines = ["| threads | system | output tokens/s min / median / max | tandem / vLLM (medians) | tokens per "
                 "CPU-second (median) | tandem / vLLM per CPU-second | startup s (median) | peak RSS GiB (median) | "
                 "peak PSS GiB (median) | identical greedy outputs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t, cell in (res.get("offline") or {}).items():
        for s in SYSTEMS:
            c = cell.get(s) or {}
            tp = c.get("tokens_per_s") or {}
            ratio = f"**{cell['ratio']:.2f}x**" if s == "tandem" and cell.get("ratio") else ""
            cpu_ratio = f"{cell['cpu_ratio']:.2f}x" if s == "tandem" and cell.get("cpu_ratio") else ""
            per_cpu = fmt((c.get("tokens_per_cpu_s") or {}).get("median"))
            cmp_ = cell.get("outputs") or {}
            same = ""
            if s == "tandem" and cmp_:
                same = f"{cmp_['identical']}/{cmp_['of']}"
                if cmp_.get("first_mismatch"):
                    fm = cmp_["first_mismatch"]
                    same += f" (first mismatch: request {fm['request']}, token {fm['position']})"
            vals = " / ".join(fmt(tp.get(k)) for k in ("min", "median", "max")) if tp else f"failed: {c.get('error', '')}"
            off_lines.append(f"| {t} | {s} | {vals} | {ratio} | {per_cpu} | {cpu_ratio} | {fmt(c.get('startup_s'), '.1f')} | "
                             f"{gib(c.get('peak_rss_bytes'))} | {gib(c.get('peak_pss_bytes'))} | {same} |")
    on_lines = ["| rate req/s | system | achieved req/s (min-max) | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
                "TPOT p50 min-max | ITL p50 / p99 ms | startup s | peak RSS GiB | peak PSS GiB | failed |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate, cell in (res.get("online") or {}).items():
        for s in SYSTEMS:
            m = cell.get(s) or {}
            if "error" in m:
                on_lines.append(f"| {rate} | {s} | failed: {m['error'][:120]} | | | | | | | | | |")
                continue
            rr = m.get("request_throughput_range") or [None, None]
            tr = m.get("p50_tpot_ms_range") or [None, None]
            on_lines.append(
                f"| {rate} | {s} | {fmt(m.get('request_throughput'), '.2f')} ({fmt(rr[0], '.2f')}-{fmt(rr[1], '.2f')}) | "
                f"{fmt(m.get('output_throughput'))} | "
                f"{fmt(m.get('p50_ttft_ms'))} / {fmt(m.get('p99_ttft_ms'))} | {fmt(m.get('p50_tpot_ms'), '.1f')} / "
                f"{fmt(m.get('p99_tpot_ms'), '.1f')} | {fmt(tr[0], '.1f')}-{fmt(tr[1], '.1f')} | "
                f"{fmt(m.get('p50_itl_ms'), '.1f')} / {fmt(m.get('p99_itl_ms'), '.1f')} | "
                f"{fmt(m.get('startup_s'), '.1f')} | {gib(m.get('peak_rss_bytes'))} | {gib(m.get('peak_pss_bytes'))} | "
                f"{m.get('failed', '-')}/{m.get('requests_total', m.get('requests', '-'))} |")
    return "\n".join(off_lines), "\n".join(on_lines)


def plot(res: dict, path: Path) -> None:
    """Offline tokens/s per thread count and online TPOT per rate, both systems side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    off, on = res.get("offline") or {}, res.get("online") or {}
    wl, ol = res["offline_workload"], res["online_workload"]
    panels = [p for p in (("offline", off), ("online", on)) if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    colors = {"tandem": "tab:blue", "vllm": "tab:orange"}
    for ax, (kind, data) in zip(axes[0], panels):
        keys = list(data)
        w = 0.38
        for j, s in enumerate(SYSTEMS):
            xs = [i + (j - 0.5) * w for i in range(len(keys))]
            if kind == "offline":
                st = [data[k].get(s, {}).get("tokens_per_s") or {} for k in keys]
                med = [x.get("median", 0) for x in st]
                err = [[m - x.get("min", m) for m, x in zip(med, st)], [x.get("max", m) - m for m, x in zip(med, st)]]
                ax.bar(xs, med, w, yerr=err, capsize=4, color=colors[s], label="vLLM CPU" if s == "vllm" else s)
                for x, m, hi in zip(xs, med, err[1]):
                    ax.text(x, m + hi, f"{m:.0f}", ha="center", va="bottom", fontsize=8)
            else:
                p50 = [data[k].get(s, {}).get("p50_tpot_ms") or 0 for k in keys]
                p99 = [data[k].get(s, {}).get("p99_tpot_ms") or 0 for k in keys]
                ax.bar(xs, p99, w, color=colors[s], alpha=0.35, label=f"{'vLLM CPU' if s == 'vllm' else s} p99")
                ax.bar(xs, p50, w, color=colors[s], label=f"{'vLLM CPU' if s == 'vllm' else s} p50")
                for x, a, b in zip(xs, p50, p99):
                    ax.text(x, b, f"{a:.0f}/{b:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(keys)))
        ax.margins(y=0.25)
        if kind == "offline":
            ax.set_xticklabels([f"{k} thread{'s' if str(k) != '1' else ''}" for k in keys])
            ax.set_ylabel("output tokens/s (median, min-max)")
            ax.set_title(f"offline: {wl['requests']} requests x {wl['output_len']} tokens")
        else:
            ax.set_xticklabels([f"{k} req/s" for k in keys])
            ax.set_ylabel("TPOT ms (p50 solid, p99 light)")
            ax.set_title(f"online, 1 thread: {ol['prompt_len']} in / {ol['output_len']} out")
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle(f"tandem vs vLLM {res.get('versions', {}).get('vllm', '')} CPU, {res['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
