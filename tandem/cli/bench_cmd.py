"""`tandem bench`: replay multi-round sessions against an OpenAI-compatible server (docs/bench.md).

    tandem bench --url http://127.0.0.1:8000 --workload toolbench --rate 0.5 --sessions 20 \\
        --scale 0.05 --slo-ttft 2 --slo-itl 0.1 --tokenizer models/tiny-qwen3-30m

Prints vLLM `bench serve` style metrics plus tandem's session metrics (SLO attainment, initial and
incremental TTFT, local/remote prefill split); `--json` prints one JSON object, `--out` writes it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

DEFAULT_BENCH_SESSIONS = 20


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `bench` on the subparsers `sub` of the tandem parser."""
    from tandem.cli.main import _positive_float, _positive_int, _seed

    p = sub.add_parser("bench", help="replay multi-round sessions against an OpenAI-compatible server",
                       description="Start every session of a workload at its arrival time, send its rounds as "
                                   "streamed requests (header x-session-id), sleep the tool gaps, and report "
                                   "TTFT/ITL/TPOT/E2E, throughput and SLO attainment (docs/bench.md).")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, metavar="NAME|FILE",
                   help="generator (toolbench, gaia, hotpotqa, dureader, agentic-long), public trace "
                        "(azure-conv, azure-code, mooncake, sharegpt) or a .jsonl session file")
    p.add_argument("--rate", type=_positive_float, default=None,
                   help="session arrival rate per second (default: 1 for generators; a file keeps its "
                        "arrival times unless --override-arrivals)")
    p.add_argument("--sessions", type=_positive_int, default=None,
                   help=f"sessions to generate (default: {DEFAULT_BENCH_SESSIONS}); for traces and files, the first K")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the workload and the synthetic text (default: 0)")
    p.add_argument("--override-arrivals", action="store_true",
                   help="re-time a trace's or file's sessions as a Poisson process at --rate")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name in requests (default: the first of GET /v1/models); a catalogue name "
                        "(e.g. llama-3.1-70b) also selects AMPD's SLOs for generated workloads")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--slo-ttft", type=_positive_float, default=None, metavar="S", help="TTFT SLO in seconds")
    p.add_argument("--slo-itl", type=_positive_float, default=None, metavar="S", help="mean ITL SLO in seconds")
    p.add_argument("--scale", type=_positive_float, default=1.0, metavar="F",
                   help="multiply input/output tokens (floor 1) and tool gaps by F, e.g. 0.05 for a tiny "
                        "CPU model (default: 1)")
    p.add_argument("--max-tokens-cap", type=_positive_int, default=None, metavar="N",
                   help="cap every round's output tokens at N (after --scale)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="Hugging Face checkpoint dir: synthetic text with exact token counts, and token-id "
                        "prompts with --endpoint completions (default: ~1 token per filler word)")
    p.add_argument("--tool-role", choices=("tool", "user"), default="tool",
                   help="chat: role of the message carrying a later round's new tokens (default: %(default)s)")
    p.add_argument("--no-return-token-ids", action="store_true",
                   help="completions with --tokenizer: do not ask for the completion's token ids "
                        "(vLLM's return_token_ids); re-encode the completion text instead")
    p.add_argument("--timeout", type=_positive_float, default=600.0, metavar="S",
                   help="per-request connect/read timeout in seconds (default: %(default)g)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON object to FILE")
    p.add_argument("--records", default=None, metavar="FILE.jsonl",
                   help="also write every session's per-round record (TTFT, ITL, errors) as JSON lines")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    return p


class _Bar:
    """A rich progress bar of completed sessions on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("sessions"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("sessions", total=total, failed=0)
            self.failed = 0
            self.bar.start()

    def __call__(self, rec) -> None:
        if self.bar is None:
            return
        self.failed += bool(rec.failed)
        self.bar.update(self.task, advance=1, failed=self.failed)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def cmd_bench(args) -> int:
    """`tandem bench`: load the workload, replay it against --url, print and write the metrics."""
    from tandem.bench.serve_client import BenchConfig, BenchError, run_bench
    from tandem.cli.main import CLIError, _check_out_path, _flush_notes, _load_workload

    from tandem.workload import generators
    if args.sessions is None and args.workload in tuple(getattr(generators, "GENERATOR_NAMES", generators.WORKLOADS)):
        args.sessions = DEFAULT_BENCH_SESSIONS
    sessions, rate, _ = _load_workload(args, args.model or "")
    tokenizer = None
    if args.tokenizer is not None:
        from tandem.engine.tokenizer import Tokenizer, TokenizerError
        try:
            tokenizer = Tokenizer.from_pretrained(args.tokenizer)
        except TokenizerError as e:
            raise CLIError(str(e)) from None
    _check_out_path(args.out)
    _check_out_path(args.records)
    _flush_notes()

    bar = _Bar(len(sessions), not args.no_progress and sys.stderr.isatty())
    cfg = BenchConfig(url=args.url, endpoint=args.endpoint, model=args.model,
                      api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
                      scale=args.scale, max_tokens_cap=args.max_tokens_cap, tokenizer=tokenizer, seed=args.seed,
                      timeout_s=args.timeout, tool_role=args.tool_role,
                      return_token_ids=not args.no_return_token_ids, on_session_done=bar)
    try:
        res = asyncio.run(run_bench(sessions, cfg))
    except BenchError as e:
        raise CLIError(str(e)) from None
    finally:
        bar.close()

    out = res.metrics()
    out.update({"workload": args.workload, "rate": rate, "seed": args.seed,
                "tokenizer": args.tokenizer, "tool_role": args.tool_role if args.endpoint == "chat" else None})
    text = json.dumps(out, indent=2)
    if args.records is not None:
        from tandem.workload.records import dump_records
        dump_records(res.records, args.records)
    if args.out is not None:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    if args.json:
        print(text)
    else:
        print_table(out)
    if out["sessions_completed"] == 0 and out["sessions_failed"] > 0:
        first = out["failures"][0]["reason"] if out["failures"] else "unknown"
        print(f"tandem: every session failed (first: {first})", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------- table

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
