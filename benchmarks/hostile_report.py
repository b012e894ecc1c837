"""The hostile-input run's summary (results.json), acceptance conditions, printed tables, raw.json and plot."""
from __future__ import annotations

import json
import os
import platform
import re
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from tandem.bench.host import describe_host
# benchmarks/ is the script's directory (benchmarks/hostile_run.py)
from hostile_config import HEALTH_LIMIT_S, RSS_TOLERANCE, Config, Results, console


# ---------------------------------------------------------------------------- summary and conditions
def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of xs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))] if s else float("nan")


def in_flight(res: Results, a: float, b: float) -> str:
    """What the attack had in flight between monotonic times a and b (hostile cases by name, streams by count)."""
    cases = Counter(h["case"] for h in res.hostile if h["start"] <= b and h["end"] >= a)
    streams = sum(1 for r in res.streams if r["start"] <= b and r["end"] >= a)
    ports = sorted({f"{r['role']} {r['port']}" for r in res.frames if r["start"] <= b and r["end"] >= a})
    return ", ".join([f"{n} x{k}" if k > 1 else n for n, k in cases.most_common(6)] + [f"{streams} valid streams"]
                     + [f"frames on {p}" for p in ports])


def health_summary(probes: list[tuple[float, float, int, float]], res: Results, t0: float) -> dict:
    """Latency figures of the /health probes from the baseline on (the warm-up apart), the slow or failed ones
    with what was in flight."""
    start = next((a for name, a, _ in res.phases if name == "baseline"), t0)
    warm = [p[1] for p in probes if p[0] < start]
    probes = [p for p in probes if p[0] >= start]
    lat = [p[1] for p in probes]
    bad = [p for p in probes if p[2] != 200 or p[1] >= HEALTH_LIMIT_S]
    return {"probes": len(probes), "max_ms": round(max(lat) * 1e3, 2) if lat else None,
            "p50_ms": round(percentile(lat, 50) * 1e3, 2), "p99_ms": round(percentile(lat, 99) * 1e3, 2),
            "over_100ms": sum(p[1] >= HEALTH_LIMIT_S for p in probes), "not_200": sum(p[2] != 200 for p in probes),
            "warmup": {"probes": len(warm), "max_ms": round(max(warm, default=0.0) * 1e3, 2),
                       "over_100ms": sum(x >= HEALTH_LIMIT_S for x in warm)},
            "control": {"max_ms": round(max((p[3] for p in probes), default=0.0) * 1e3, 2),
                        "p99_ms": round(percentile([p[3] for p in probes], 99) * 1e3, 2),
                        "over_100ms": sum(p[3] >= HEALTH_LIMIT_S for p in probes)},
            "bad": [{"t_s": round(p[0] - t0, 3), "ms": round(p[1] * 1e3, 1), "status": p[2],
                     "control_ms": round(p[3] * 1e3, 1), "in_flight": in_flight(res, p[0], p[0] + p[1])}
                    for p in bad][:50]}


def server_log_summary(log: Path) -> dict:
    """Tracebacks, internal errors and the readers' drop tallies in the server log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    drops: dict[str, int] = {}
    for where, n in re.findall(r"^(.+?): dropped .*; (\d+) dropped in all$", text, re.M):
        drops[where] = max(drops.get(where, 0), int(n))
    errors = Counter(re.findall(r"^(\w[\w.]*(?:Error|Exception|Disconnect)\b.*)$", text, re.M))
    return {"tracebacks": text.count("Traceback (most recent call last)"),
            "internal_errors": Counter(re.findall(r"^internal error on (.+)$", text, re.M)),
            "exceptions": dict(errors.most_common(10)), "drops_at_least": drops}


def frames_summary(rows: list[dict]) -> list[dict]:
    """Per socket and probe: the outcomes seen and how often."""
    out: dict[tuple, Counter] = {}
    for r in rows:
        out.setdefault((r["port"], r["role"], r["pid"], r["probe"]), Counter())[r["outcome"]] += 1
    return [{"port": k[0], "role": k[1], "pid": k[2], "probe": k[3], "outcomes": dict(v)} for k, v in out.items()]


def frame_failures(rows: list[dict]) -> list[str]:
    """The coordinator's control port must never accept a keyless ZeroMQ handshake."""
    return sorted({f"port {r['port']} ({r['role']}): {r['probe']} {r['outcome']}" for r in rows
                   if r["role"] == "coordinator" and r["outcome"].startswith("accepted")})


def summarize(cfg: Config, res: Results, probes: list, facts: dict, stop: dict, log: dict, t0: float) -> dict:
    """Everything that results.json holds."""
    statuses = Counter(str(h["status"]) for h in res.hostile)
    hostile_bad = [h for h in res.hostile if h["failure"]] + [s for s in res.slow if s["failure"]]
    valid_bad = [s for s in res.streams if s["failure"]]
    rss0, rss1 = facts["rss_start"], facts["rss_end"]
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "health": health_summary(probes, res, t0),
        "valid": {"answered": len(res.streams) - len(valid_bad), "sent": len(res.streams),
                  "waves": len({s["wave"] for s in res.streams}), "warmup_failures": res.warmup_failures,
                  "failures": valid_bad[:50], "p50_s": round(percentile([s["seconds"] for s in res.streams], 50), 3),
                  "max_s": round(max((s["seconds"] for s in res.streams), default=0.0), 3)},
        "hostile": {"requests": len(res.hostile), "rounds": len({h["round"] for h in res.hostile}),
                    "by_status": dict(sorted(statuses.items())), "failed": len(hostile_bad),
                    "failures": _dedupe(hostile_bad), "slow_clients": res.slow,
                    "reset_while_sending": dict(Counter(h["case"] for h in res.hostile if "while sending" in h["note"]))},
        "sockets": {"listening": facts["sockets"], "probes": len(res.frames), "by_probe": frames_summary(res.frames),
                    "failures": frame_failures(res.frames), "pids_before": facts["pids_before"],
                    "pids_after": facts["pids_after"], "workers_alive": facts["workers_alive"]},
        "rss": {"start_mb": round(rss0 / 2 ** 20, 1), "end_mb": round(rss1 / 2 ** 20, 1),
                "peak_mb": round(max((r[1] for r in res.rss), default=rss1) / 2 ** 20, 1), "ratio": round(rss1 / rss0, 4)},
        "shutdown": stop, "server_log": log, "cpu_cores_during_attack": facts["cpu_during_attack"],
        "load_avg_after_attack": facts["load_avg_after_attack"],
        "phases": [{"name": n, "from_s": round(a - t0, 2), "to_s": round(b - t0, 2)} for n, a, b in res.phases],
    }


def _dedupe(rows: list[dict]) -> list[dict]:
    """Failures grouped by case (or client) and reason, with a count (monotonic times left out)."""
    seen: Counter = Counter()
    first: dict[tuple, dict] = {}
    for r in rows:
        key = (r.get("case") or r.get("client", "").split(" ")[0], r["failure"][:160])
        seen[key] += 1
        first.setdefault(key, r)
    drop = ("start", "end", "round")
    return [{**{k2: v for k2, v in first[k].items() if k2 not in drop}, "count": n} for k, n in seen.items()]


def conditions(s: dict) -> list[tuple[str, bool, str]]:
    """(condition, met, detail) for each acceptance condition."""
    h, v, hs, so, r, st = s["health"], s["valid"], s["hostile"], s["sockets"], s["rss"], s["shutdown"]
    lost = sorted(set(so["pids_before"]) - set(so["pids_after"]))
    return [
        ("/health within 100 ms throughout", h["over_100ms"] == 0 and h["not_200"] == 0 and h["probes"] > 0,
         f"{h['probes']} probes, max {h['max_ms']} ms, {h['over_100ms']} over 100 ms, {h['not_200']} not 200"),
        ("every valid request answered", v["answered"] == v["sent"] and v["sent"] > 0 and not v["warmup_failures"],
         f"{v['answered']}/{v['sent']} streams in {v['waves']} wave(s)"),
        ("coordinator RSS back within 10%", abs(r["ratio"] - 1) <= RSS_TOLERANCE,
         f"{r['start_mb']} -> {r['end_mb']} MB (x{r['ratio']}, peak {r['peak_mb']} MB)"),
        ("every hostile input refused properly", hs["failed"] == 0,
         f"{hs['requests']} requests + {len(hs['slow_clients'])} slow clients, {hs['failed']} wrong"),
        ("every socket probed, cluster intact", not so["failures"] and not lost and so["probes"] > 0
         and so["workers_alive"] == 2, f"{len(so['listening'])} sockets, {so['probes']} probes, "
         f"lost pids {lost or 'none'}, workers_alive {so['workers_alive']}" +
         (f"; {'; '.join(so['failures'])}" if so["failures"] else "")),
        ("no internal error in the server log", not s["server_log"]["internal_errors"],
         f"{s['server_log']['tracebacks']} tracebacks, internal errors "
         f"{dict(s['server_log']['internal_errors']) or 'none'}"),
        ("clean stop, nothing left over", not st["left_over_killed"],
         f"{st['signal']}, exit {st['exit_code']} in {st['seconds']} s, left over {st['left_over_killed'] or 'none'}"),
    ]


# ---------------------------------------------------------------------------- output
def print_report(s: dict, conds: list[tuple[str, bool, str]]) -> None:
    """The rich tables: acceptance conditions, hostile statuses, sockets, failures."""
    t = Table(title="Hostile-input run")
    for col in ("condition", "result", "measured"):
        t.add_column(col)
    for name, ok, detail in conds:
        t.add_row(name, "[green]pass[/]" if ok else "[red]FAIL[/]", detail)
    h = s["health"]
    t.add_row("  /health latency", "", f"p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, max {h['max_ms']} ms; "
              f"warm-up (not counted): max {h['warmup']['max_ms']} ms, {h['warmup']['over_100ms']} over 100 ms")
    c = h["control"]
    t.add_row("  control probe (no server)", "", f"p99 {c['p99_ms']} ms, max {c['max_ms']} ms, {c['over_100ms']} over "
              "100 ms: the machine's and the prober's own noise")
    t.add_row("  hostile by status", "", ", ".join(f"{k}: {v}" for k, v in s["hostile"]["by_status"].items()))
    console.print(t)
    sockets = Table(title="Sockets probed (outcomes over all rounds)")
    for col in ("port", "role", "probe", "outcomes"):
        sockets.add_column(col)
    for row in s["sockets"]["by_probe"]:
        sockets.add_row(str(row["port"]), row["role"], row["probe"],
                        ", ".join(f"{k} x{n}" for k, n in row["outcomes"].items()))
    console.print(sockets)
    _print_failures(s)


def _print_failures(s: dict) -> None:
    """Each distinct failure, once."""
    rows = [(f.get("case") or f.get("client"), f["failure"], f.get("count", 1)) for f in s["hostile"]["failures"]]
    rows += [(f"stream w{f['wave']} #{f['i']}", f["failure"], 1) for f in s["valid"]["failures"][:10]]
    rows += [(f"/health at {b['t_s']} s", f"{b['ms']} ms, status {b['status']} (control probe {b['control_ms']} ms); "
              f"in flight: {b['in_flight']}", 1)
             for b in s["health"]["bad"][:10]]
    if not rows:
        return
    t = Table(title="Failures")
    for col in ("what", "why", "count"):
        t.add_column(col)
    for what, why, n in rows:
        t.add_row(str(what), why[:300], str(n))
    console.print(t)
    log = s["server_log"]
    if log["tracebacks"]:
        console.print(f"server log: {log['tracebacks']} tracebacks; internal errors {dict(log['internal_errors'])}; "
                      f"exceptions {log['exceptions']}")


PHASE_COLOURS = {"warm-up": "#f4f4f4", "baseline": "#dddddd", "attack": "#ffd8b0", "settle": "#d0e8ff"}


def plot(path: Path, probes: list, res: Results, t0: float) -> None:
    """Health-probe latency over time, phases shaded, the 100 ms limit, coordinator RSS on a second axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for k, (name, a, b) in enumerate(res.phases):
        ax.axvspan(a - t0, b - t0, color=PHASE_COLOURS.get(name, "#eeeeee"), alpha=0.6, lw=0)
        ax.text((a + b) / 2 - t0, 0.97 - 0.06 * (k % 2), name, transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=9)
    for wave in sorted({r["wave"] for r in res.streams}):
        first = min(r["start"] for r in res.streams if r["wave"] == wave)
        n = sum(r["wave"] == wave for r in res.streams)
        ax.axvline(first - t0, color="#9467bd", ls=":", lw=1)
        ax.text(first - t0, 0.80, f" {n} streams", transform=ax.get_xaxis_transform(), color="#9467bd", fontsize=8)
    ok = [(p[0] - t0, p[1] * 1e3) for p in probes if p[2] == 200]
    bad = [(p[0] - t0, p[1] * 1e3) for p in probes if p[2] != 200]
    ax.plot([p[0] - t0 for p in probes], [p[3] * 1e3 for p in probes], ".", ms=1.5, color="#999999",
            label="control probe (trivial server)")
    ax.plot([x for x, _ in ok], [y for _, y in ok], ".", ms=2, color="#1f77b4", label="/health latency (200)")
    if bad:
        ax.plot([x for x, _ in bad], [y for _, y in bad], "x", color="red", label="/health not 200")
    ax.axhline(HEALTH_LIMIT_S * 1e3, color="red", ls="--", lw=1, label="100 ms")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the prober started")
    ax.set_ylabel("/health latency (ms)")
    if res.rss:
        ax2 = ax.twinx()
        ax2.plot([r[0] - t0 for r in res.rss], [r[1] / 2 ** 20 for r in res.rss], color="#2ca02c", lw=1.2,
                 label="coordinator RSS")
        ax2.set_ylabel("coordinator RSS (MB)")
        ax2.legend(loc="lower right", fontsize=8)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("tandem serve 1P+1D under hostile input: /health probes and coordinator memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_raw(path: Path, probes: list, res: Results, t0: float) -> None:
    """Every probe, request and sample, times in seconds since the prober started (for a closer look)."""
    def rel(rows: list[dict]) -> list[dict]:
        return [{**r, **{k: round(r[k] - t0, 4) for k in ("start", "end") if k in r}} for r in rows]
    raw = {"probes": [(round(t - t0, 4), round(lat * 1e3, 2), st, round(c * 1e3, 2)) for t, lat, st, c in probes],
           "hostile": rel(res.hostile), "streams": rel(res.streams), "frames": rel(res.frames), "slow": res.slow,
           "rss": [(round(t - t0, 2), r) for t, r in res.rss]}
    path.write_text(json.dumps(raw, default=str))


def machine() -> dict:
    """Where the run ran."""
    return {"cpu": describe_host().cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
