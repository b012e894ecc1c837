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

from tandem.cli.bench_table import print_table
from tandem.cli.common import (CLIError, SessionBar, check_out_path, flush_notes, load_workload, positive_float, positive_int,
                               seed_arg)

DEFAULT_BENCH_SESSIONS = 20


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `bench` on the subparsers `sub` of the tandem parser."""
    p = sub.add_parser("bench", help="replay multi-round sessions against an OpenAI-compatible server",
                       description="Start every session of a workload at its arrival time, send its rounds as "
                                   "streamed requests (header x-session-id), sleep the tool gaps, and report "
                                   "TTFT/ITL/TPOT/E2E, throughput and SLO attainment (docs/bench.md).")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, metavar="NAME|FILE",
                   help="generator (toolbench, gaia, hotpotqa, dureader, agentic-long, chat-multiturn), public trace "
                        "(azure-conv, azure-code, mooncake, sharegpt) or a .jsonl session file")
    p.add_argument("--rate", type=positive_float, default=None,
                   help="session arrival rate per second (default: 1 for generators; a file keeps its "
                        "arrival times unless --override-arrivals)")
    p.add_argument("--sessions", type=positive_int, default=None,
                   help=f"sessions to generate (default: {DEFAULT_BENCH_SESSIONS}); for traces and files, the first K")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the workload and the synthetic text (default: 0)")
    p.add_argument("--override-arrivals", action="store_true",
                   help="re-time a trace's or file's sessions as a Poisson process at --rate")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions or /v1/completions (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name in requests (default: the first of GET /v1/models); a catalogue name "
                        "(e.g. llama-3.1-70b) also selects AMPD's SLOs for generated workloads")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--slo-ttft", type=positive_float, default=None, metavar="S", help="TTFT SLO in seconds")
    p.add_argument("--slo-itl", type=positive_float, default=None, metavar="S", help="mean ITL SLO in seconds")
    p.add_argument("--scale", type=positive_float, default=1.0, metavar="F",
                   help="multiply input/output tokens (floor 1) and tool gaps by F, e.g. 0.05 for a tiny "
                        "CPU model (default: 1)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=None, metavar="N",
                   help="cap every round's output tokens at N (after --scale)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="Hugging Face checkpoint dir: synthetic text with exact token counts, and token-id "
                        "prompts with --endpoint completions (default: ~1 token per filler word)")
    p.add_argument("--tool-role", choices=("tool", "user"), default="tool",
                   help="chat: role of the message carrying a later round's new tokens (default: %(default)s)")
    p.add_argument("--no-return-token-ids", action="store_true",
                   help="completions with --tokenizer: do not ask for the completion's token ids "
                        "(vLLM's return_token_ids); re-encode the completion text instead")
    p.add_argument("--timeout", type=positive_float, default=600.0, metavar="S",
                   help="per-request connect/read timeout in seconds (default: %(default)g)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON object to FILE")
    p.add_argument("--records", default=None, metavar="FILE.jsonl",
                   help="also write every session's per-round record (TTFT, ITL, errors) as JSON lines")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args) -> int:
    """`tandem bench`: load the workload, replay it against --url, print and write the metrics."""
    from tandem.bench.serve_client import BenchConfig, BenchError, run_bench
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
    cfg = BenchConfig(url=args.url, endpoint=args.endpoint, model=args.model,
                      api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
                      scale=args.scale, max_tokens_cap=args.max_tokens_cap, tokenizer=tokenizer, seed=args.seed,
                      timeout_s=args.timeout, tool_role=args.tool_role,
                      return_token_ids=not args.no_return_token_ids,
                      on_session_done=bar.track("sessions", len(sessions)))
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
