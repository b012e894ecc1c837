"""The `tandem bench` metrics as a rich table (vLLM `bench serve` sections plus tandem's session metrics).

Printed by `tandem bench` and `tandem demo`.
"""
from __future__ import annotations

_SECTIONS: list[tuple[str, list[tuple[str, str, str]]]] = [
    # (section, [(key, label, format)]); formats: i integer, f float, s seconds, m milliseconds, p percent
    ("Requests (rounds)", [
        ("completed", "completed", "i"), ("failed", "failed", "i"), ("rounds_not_run", "not run (session failed)", "i"),
        ("duration", "duration (s)", "f"), ("total_input_tokens", "input tokens (prompts, usage)", "i"),
        ("total_new_input_tokens", "new input tokens (workload)", "i"),
        ("total_cached_tokens", "cached prompt tokens", "i"), ("cached_token_fraction", "cached share", "p"),
        ("total_output_tokens", "output tokens", "i"), ("rounds_short_output", "rounds short of max_tokens", "i"),
        ("request_throughput", "request throughput (req/s)", "f"),
        ("output_throughput", "output throughput (tok/s)", "f"),
        ("total_token_throughput", "total token throughput (tok/s)", "f"),
    ]),
    ("Latency (ms)", [
        *[(f"{s}_{n}_ms", f"{s} {n.upper()}", "m") for n in ("ttft", "tpot", "itl", "e2el")
          for s in ("mean", "median", "p95", "p99")],
    ]),
    ("Sessions", [
        ("sessions_total", "sessions", "i"), ("sessions_completed", "completed", "i"),
        ("sessions_failed", "failed", "i"), ("slo_attainment", "SLO attainment", "p"),
        ("round_slo_attainment", "round SLO attainment", "p"),
        ("goodput_sessions_per_s", "goodput (sessions/s)", "f"),
        ("ttft_initial_mean_s", "TTFT initial mean (s)", "s"), ("ttft_initial_p95_s", "TTFT initial p95 (s)", "s"),
        ("ttft_incremental_mean_s", "TTFT incremental mean (s)", "s"),
        ("ttft_incremental_p95_s", "TTFT incremental p95 (s)", "s"),
        ("itl_mean_s", "ITL mean (s)", "s"), ("session_e2e_mean_s", "session E2E mean (s)", "s"),
    ]),
    ("Server", [
        ("local_prefills", "local prefills", "i"), ("remote_prefills", "remote prefills", "i"),
        ("local_prefill_fraction", "local prefill share", "p"),
    ]),
]


def _fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "i":
        return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"
    if kind == "p":
        return f"{100 * v:.1f}%"
    if kind == "m":
        return f"{v:.2f}"
    if kind == "s":
        return f"{v:.4f}"
    return f"{v:.4g}"


def print_table(out: dict) -> None:
    """The metrics as a rich table on stdout, then every failure kind."""
    from rich.console import Console
    from rich.table import Table

    rate = "file arrivals" if out.get("rate") is None else f"{out['rate']:g} sessions/s"
    title = (f"{out.get('workload')} → {out['url']} · {out['model']} · {out['endpoint']} · {rate} · "
             f"seed {out.get('seed')} · scale {out['scale']:g} · text {out['text_mode']}")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for i, (section, rows) in enumerate(_SECTIONS):
        table.add_row(f"[bold]{section}[/bold]", "", end_section=False)
        for key, label, kind in rows:
            table.add_row("  " + label, _fmt(out.get(key), kind), end_section=False)
        if i < len(_SECTIONS) - 1:
            table.add_section()
    console = Console(soft_wrap=True)
    console.print(table)
    for kind, count in (out.get("fail_reasons") or {}).items():
        first = next((f for f in out.get("failures", []) if f["reason"].split(": ", 1)[0] == kind), None)
        example = f" (e.g. {first['session_id']} round {first['round']}: {first['reason']})" if first else ""
        console.print(f"failed x{count}: {kind}{example}", markup=False, highlight=False)
