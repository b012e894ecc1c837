"""Request-body parsers, compared: time to an answer and the longest event-loop stall while a body is parsed.

Each parser runs on a worker thread (as the server's preparation threads do) while the event loop ticks every
millisecond; the loop's longest late tick is the stall a concurrent /health would have seen (the GIL switch interval
is the server's, 1 ms). Candidates:

* `pure-python` - the decoder tandem used before: json's pure-Python scanner with an array cap (it yields the GIL
  every few ms but is slow), then pydantic's `model_validate` on the Python objects; the baseline of the ratio;
* `check+json` / `check+msgspec` / `check+orjson` - the structure check (`tandem.server.body.check_structure`), then a
  C parser, then `model_validate`;
* `check+pydantic` - the structure check, then pydantic's `model_validate_json` (Rust, one call): tandem's choice.

    python benchmarks/body_parse.py [--repeat 3]

Bodies: hostile ones (700k logit_bias keys, the same as an unknown field, 200k nested arrays) and large valid ones
(a 7 MB prompt, 512 messages, tool schemas with 15,000 properties, a prompt of 131,000 token ids under a 131,072
context). Rows are medians of `--repeat` runs; `x` is the pure-Python decoder's time over the row's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import json.decoder
import json.scanner
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from tandem.server.body import BodyLimits, check_structure, decode
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.bench.host import describe_host

try:
    import orjson
except ImportError:                      # optional: its rows say so
    orjson = None

TICK_S = 0.001


# ---------------------------------------------------------------------------- the previous decoder (baseline)
class _ArrayTooLong(ValueError):
    pass


_NOT_INT_CHAR = re.compile(r"[^0-9, \t\n\r-]")


def _int_run_end(s: str, start: int, max_array: int, chunk: int = 1 << 16) -> int:
    pos, commas = start, 0
    while pos < len(s):
        stop = _NOT_INT_CHAR.search(s, pos, pos + chunk)
        if stop is not None:
            return stop.start()
        commas += s.count(",", pos, pos + chunk)
        if commas >= max_array:
            raise _ArrayTooLong(max_array)
        pos += chunk
    return -1


def pure_python_decoder(max_array: int) -> json.JSONDecoder:
    """The pure-Python JSON decoder with an array cap that tandem used before the structure check."""
    dec = json.JSONDecoder()
    ws = json.decoder.WHITESPACE.match

    def parse_array(s_and_end: tuple[str, int], scan_once: Callable, _w: Callable = ws,
                    _ws: str = json.decoder.WHITESPACE_STR) -> tuple[list, int]:
        s, end = s_and_end
        close = _int_run_end(s, end, max_array)
        if close > end and s[close] == "]":
            body = s[end:close]
            if body.count(",") + 1 > max_array:
                raise _ArrayTooLong(max_array)
            try:
                return [int(x) for x in body.split(",")], close + 1
            except ValueError:
                pass
        values: list = []
        nextchar = s[end:end + 1]
        if nextchar in _ws:
            end = _w(s, end + 1).end()
            nextchar = s[end:end + 1]
        if nextchar == "]":
            return values, end + 1
        while True:
            value, end = scan_once(s, end)
            values.append(value)
            if len(values) > max_array:
                raise _ArrayTooLong(max_array)
            nextchar = s[end:end + 1]
            if nextchar in _ws:
                end = _w(s, end + 1).end()
                nextchar = s[end:end + 1]
            end += 1
            if nextchar == "]":
                break
            if nextchar != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", s, end - 1)
            if s[end:end + 1] in _ws:
                end = _w(s, end + 1).end()
        return values, end

    dec.parse_array = parse_array
    dec.scan_once = json.scanner.py_make_scanner(dec)
    return dec


# ---------------------------------------------------------------------------- candidates
def _pure_python(raw: bytes, model: type, limits: BodyLimits) -> Any:
    return model.model_validate(pure_python_decoder(limits.max_array).decode(raw.decode("utf-8")))


def _checked(loads: Callable[[bytes], Any]) -> Callable[[bytes, type, BodyLimits], Any]:
    def parse(raw: bytes, model: type, limits: BodyLimits) -> Any:
        check_structure(raw, limits)
        return model.model_validate(loads(raw))
    return parse


PARSERS: dict[str, Callable[[bytes, type, BodyLimits], Any] | None] = {
    "pure-python": _pure_python,
    "check+json": _checked(json.loads),
    "check+msgspec": _checked(msgspec.json.decode),
    "check+orjson": _checked(orjson.loads) if orjson is not None else None,
    "check+pydantic": decode,
}


def bodies() -> list[tuple[str, bytes, type, int]]:
    """(name, body, request model, longest array allowed)."""
    tools = [{"type": "function", "function": {"name": f"f{t}", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "d"} for i in range(3750)}}}} for t in range(4)]
    many = {str(i): 1 for i in range(700_000)}
    compact = {"separators": (",", ":")}
    return [
        ("logit_bias 700k keys", json.dumps({"prompt": "hi", "logit_bias": many}, **compact).encode(),
         CompletionRequest, 512),
        ("unknown field 700k keys", json.dumps({"prompt": "hi", "extra": many}, **compact).encode(),
         CompletionRequest, 512),
        ("200k nested arrays", b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", CompletionRequest, 512),
        ("7 MB prompt", json.dumps({"prompt": "hello world " * 600_000}).encode(), CompletionRequest, 512),
        ("512 messages", json.dumps({"messages": [{"role": "user", "content": "hello there " * 10}] * 512}).encode(),
         ChatCompletionRequest, 512),
        ("15k tool properties", json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": tools}).encode(),
         ChatCompletionRequest, 512),
        ("131k token ids", json.dumps({"prompt": list(range(131_000))}).encode(), CompletionRequest, 131_072),
    ]


async def _timed(pool: ThreadPoolExecutor, fn: Callable[[], Any]) -> tuple[float, float, str]:
    """(seconds to the answer, the longest event-loop stall, the outcome) of fn() run on `pool`."""
    loop = asyncio.get_running_loop()
    stall = 0.0
    t0 = time.perf_counter()
    fut = loop.run_in_executor(pool, fn)
    while not fut.done():
        s = time.perf_counter()
        await asyncio.sleep(TICK_S)
        stall = max(stall, time.perf_counter() - s - TICK_S)
    took = time.perf_counter() - t0
    try:
        fut.result()
        outcome = "ok"
    except APIError as e:
        outcome = f"400 {e.param or ''}".strip()
    except Exception as e:  # noqa: BLE001 - a parser's own failure is an outcome of the row
        outcome = type(e).__name__
    return took, stall, outcome


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.setswitchinterval(TICK_S)                   # the serving process's (tandem.server.process)
    cpu = describe_host().cpu
    print(f"CPU: {cpu}; Python {platform.python_version()}; msgspec {msgspec.__version__}; "
          f"orjson {getattr(orjson, '__version__', 'not installed')}; repeat {args.repeat} (median)")
    print(f"{'body':<24} {'MB':>5}  {'parser':<15} {'answer ms':>10} {'max stall ms':>13} {'x':>7}  outcome")
    with ThreadPoolExecutor(1) as pool:
        for name, raw, model, max_array in bodies():
            limits = BodyLimits(max_array=max_array)
            base = None
            for pname, parser in PARSERS.items():
                if parser is None:
                    print(f"{name:<24} {len(raw) / 1e6:5.2f}  {pname:<15} {'-':>10} {'-':>13} {'-':>7}  not installed")
                    continue
                runs = [asyncio.run(_timed(pool, lambda p=parser: p(raw, model, limits))) for _ in range(args.repeat)]
                took = statistics.median(r[0] for r in runs)
                stall = statistics.median(r[1] for r in runs)
                base = took if base is None else base
                print(f"{name:<24} {len(raw) / 1e6:5.2f}  {pname:<15} {took * 1e3:10.1f} {stall * 1e3:13.1f} "
                      f"{base / took:6.1f}x  {runs[0][2]}")


if __name__ == "__main__":
    main()
