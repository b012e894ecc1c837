"""The GPU roofline report: table.md, results.json and gpu_roofline.png from analysed profiles and a decode sweep."""
from __future__ import annotations

import json
from pathlib import Path

from tandem.bench.gpu_roofline import KINDS, analyse_profile


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def table_md(res: dict) -> str:
    """The report: environment, measured/roofline by kind for each profile, the decode sweep."""
    env = res.get("env", {})
    out = ["# Engine on a GPU against the roofline (benchmarks/gpu_roofline.py)", ""]
    if env:
        out += [f"- device: {env.get('device')}; torch {env.get('torch')} (CUDA {env.get('cuda')}); "
                f"flash_attn importable: {env.get('flash_attn')}; attention backend: {env.get('attention_backend')}",
                f"- checkpoint: {env.get('checkpoint')}", ""]
    for p in res.get("profiles", []):
        out += [f"## Profile, decode {'as CUDA graphs' if p['mode'] == 'graphs' else 'eager (enforce_eager)'}: "
                f"measured / roofline ({p['model']} on {p['gpu']}, tp1)", "",
                f"{len(p['rows'])} steps up to {p['profiled_max_len']} tokens, max_model_len {p['max_model_len']}, "
                f"blocks of {p['block_size']}; profile wall {p['wall_s']:.0f} s. Roofline = max(compute at MFU 0.7, "
                f"memory at MBU 0.8) + 2 ms step overhead.", "",
                "| steps | n | median | min | max |", "|---|---|---|---|---|"]
        for name, s in [*p["by_kind"].items(), *(("bound: " + k, v) for k, v in p["by_bound"].items()),
                        ("all", p["all"])]:
            if s["n"]:
                out.append(f"| {name} | {s['n']} | {s['median']:.2f} | {s['min']:.2f} | {s['max']:.2f} |")
        he = p.get("heldout_error") or {}
        if he.get("median") is not None:
            out += ["", f"The profiler's own fitted step model on the {he['n']} held-out steps: relative error median "
                        f"{100 * he['median']:.1f}%, p90 {100 * he['p90']:.1f}%, max {100 * he['max']:.1f}%."]
        out.append("")
    sw = res.get("decode_sweep")
    if sw:
        cap = sw["capture"]
        out += [f"## Decode steps at context {sw['ctx']} (ms, median of {sw['reps']}; max_model_len "
                f"{sw['max_model_len']}, blocks of {sw['block_size']})", "",
                f"Engine graphs: {cap['sizes']} sizes ({cap['first']}..{cap['last']}) captured in "
                f"{cap['capture_s']:.1f} s, graph pool {cap['pool_bytes'] / 2**20:.0f} MiB reserved "
                f"({cap['allocated_bytes'] / 2**20:.0f} MiB allocated); decode attention in the graph: "
                f"{cap['attention']}.", ""]
        names = list(sw["variants"])
        head = ["batch", *names, "speed-up graphs/eager", "roofline", "graphs / roofline", "eager / roofline"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, b in enumerate(sw["batches"]):
            v = {n: sw["variants"][n]["median_s"][i] for n in names}
            roof = sw["roofline_s"][i]
            out.append("| " + " | ".join([str(b), *(_ms(v[n]) for n in names), f"{v['eager'] / v['graphs']:.2f}x",
                                          _ms(roof), f"{v['graphs'] / roof:.2f}", f"{v['eager'] / roof:.2f}"]) + " |")
        out.append("")
        for n in names:
            if sw["variants"][n].get("note"):
                out.append(f"- {n}: {sw['variants'][n]['note']}")
        out.append("")
    an = res.get("anatomy")
    if an:
        out += [f"## Where a step's time goes (context {an['ctx']}, max_model_len {an['max_model_len']})", "",
                f"One tiny CUDA op issued from Python costs {an['host_op_us']:.1f} us on this host. GPU kernel time "
                f"and counts per step from torch.profiler; wall time without the profiler (median of 10).", "",
                "| step | mode | wall ms | GPU kernels ms | kernels | kernel launches | roofline ms |",
                "|---|---|---|---|---|---|---|"]
        for c in an["cases"]:
            out.append(f"| {c['step']} | {c['mode']} | {c['wall_ms']:.2f} | {c['gpu_kernel_ms']:.2f} | "
                       f"{c['kernels']:.0f} | {c['launches']:.0f} | {c['roofline_ms']:.2f} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def plot(res: dict, path: Path) -> None:
    """Measured against roofline for every step (both profiles), and the decode sweep against batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    sw = res.get("decode_sweep")
    fig, axes = plt.subplots(1, 2 if sw else 1, figsize=(13 if sw else 6.5, 5.2), squeeze=False)
    ax = axes[0][0]
    colors = {"prefill": "tab:blue", "decode": "tab:red", "mixed": "tab:green"}
    markers = {"graphs": "o", "eager": "x"}
    lo, hi = float("inf"), 0.0
    for p in res.get("profiles", []):
        for k in KINDS:
            rows = [r for r in p["rows"] if r["kind"] == k]
            if rows:
                xs, ys = [1e3 * r["roofline_s"] for r in rows], [1e3 * r["measured_s"] for r in rows]
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
                ax.scatter(xs, ys, s=14, c=colors[k], marker=markers[p["mode"]], alpha=0.6,
                           label=f"{k} ({p['mode']})")
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="measured = roofline")
        ax.plot([lo, hi], [2 * lo, 2 * hi], "k--", lw=0.6, label="2x roofline")
    ax.set(xscale="log", yscale="log", xlabel="roofline step time (ms)", ylabel="measured step time (ms)")
    title = res.get("profiles", [{}])[0].get("model", "") if res.get("profiles") else ""
    ax.set_title(f"every profiled step, {title} on {res.get('env', {}).get('device', 'the GPU')}", fontsize=9)
    ax.legend(fontsize=7)
    for a in (ax.xaxis, ax.yaxis):
        a.set_major_formatter(plain)
        a.set_minor_formatter(NullFormatter())
    if sw:
        ax = axes[0][1]
        for n, v in sw["variants"].items():
            ax.plot(sw["batches"], [1e3 * s for s in v["median_s"]], marker="o", ms=4, label=n,
                    ls="-" if n in ("graphs", "eager") else ":")
        ax.plot(sw["batches"], [1e3 * s for s in sw["roofline_s"]], "k-", lw=1.5, label="roofline")
        ax.set(xscale="log", yscale="log", xlabel="decode batch size", ylabel="step time (ms)",
               title=f"decode steps at context {sw['ctx']}")
        ax.set_xticks(sw["batches"])
        for a in (ax.xaxis, ax.yaxis):
            a.set_major_formatter(plain)
            a.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def saved_results(profiles: list[Path], sweeps: list[Path], gpu: str | None = None) -> dict:
    """The results of saved profiles re-analysed, with the environment, decode sweep and step anatomy of earlier
    results.json files (later files add what earlier ones lack)."""
    res: dict = {}
    for f in sweeps:
        old = json.loads(f.read_text())
        res.update({k: old[k] for k in ("args", "env", "decode_sweep", "anatomy") if k in old and k not in res})
    res["profiles"] = [analyse_profile(json.loads(f.read_text()), gpu) for f in profiles]
    return res


def write_report(res: dict, out: Path) -> str:
    """results.json, table.md and gpu_roofline.png under `out`; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    md = table_md(res)
    (out / "table.md").write_text(md + "\n")
    plot(res, out / "gpu_roofline.png")
    return md
