"""`tandem bench`: replay multi-round sessions against an OpenAI-compatible server (docs/bench.md).

    tandem bench --url http://127.0.0.1:8000 --workload toolbench --rate 0.5 --sessions 20 \\
        --scale 0.05 --slo-ttft 2 --slo-itl 0.1 --tokenizer models/tiny-qwen3-30m

Prints vLLM `bench serve` style metrics plus tandem's session metrics (SLO attainment, initial and
incremental TTFT, local/remote prefill split); `--json` prints one JSON object, `--out` writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tandem.bench.bench_options import DEFAULT_BENCH_SESSIONS, BenchConfig, BenchOptions
from tandem.cli.args import add_knobs, knob_values
from tandem.cli.bench_table import print_table
from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import CLIError, SessionBar, check_out_path, flush_notes, load_workload
from tandem.cli.options import OutputOptions, ReportFileOptions
from tandem.workload.options import WorkloadOptions


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `bench` on the subparsers `sub` of the tandem parser."""
    p = sub.add_parser("bench", help=COMMAND_HELP["bench"],
                       description="Start every session of a workload at its arrival time, send its rounds as "
                                   "streamed requests (header x-session-id), sleep the tool gaps, and report "
                                   "TTFT/ITL/TPOT/E2E, throughput and SLO attainment (docs/bench.md).")
    add_knobs(p, BenchConfig, ("url",))
    add_knobs(p, WorkloadOptions, ("workload",), required=("workload",))
    add_knobs(p, WorkloadOptions, ("rate",))
    add_knobs(p, BenchOptions, ("sessions",))
    add_knobs(p, WorkloadOptions, ("seed", "override_arrivals"))
    add_knobs(p, BenchConfig, ("endpoint", "model", "api_key"))
    add_knobs(p, WorkloadOptions, ("slo_ttft", "slo_itl"))
    add_knobs(p, BenchConfig, ("scale", "max_tokens_cap"))
    add_knobs(p, BenchOptions, ("tokenizer",))
    add_knobs(p, BenchConfig, ("tool_role", "return_token_ids", "timeout_s"))
    add_knobs(p, OutputOptions, ("json",))
    add_knobs(p, ReportFileOptions)
    add_knobs(p, OutputOptions, ("records", "no_progress"))
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args) -> int:
    """`tandem bench`: load the workload, replay it against --url, print and write the metrics."""
    import asyncio

    from tandem.bench.serve_client import BenchError, run_bench
    from tandem.workload import generators

    if args.sessions is None and args.workload in generators.GENERATOR_NAMES:
        args.sessions = DEFAULT_BENCH_SESSIONS
    sessions, rate, _ = load_workload(args, args.model or "")
    tokenizer = None
    if args.tokenizer is not None:
        from tandem.engine.tokenizer import Tokenizer, TokenizerError
        try:
            tokenizer = Tokenizer.from_pretrained(args.tokenizer)
        except TokenizerError as e:
            raise CLIError(str(e)) from None
    check_out_path(args.out)
    check_out_path(args.records)
    flush_notes()

    bar = SessionBar(not args.no_progress and sys.stderr.isatty())
    knobs = knob_values(args, BenchConfig)
    knobs.update(api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None, tokenizer=tokenizer,
                 on_session_done=bar.track("sessions", len(sessions)))
    cfg = BenchConfig(**knobs)
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
