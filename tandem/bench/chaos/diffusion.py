"""Greedy block-diffusion decoding under load: a `tandem serve` of the tiny SDAR checkpoint, started as the docs
start it (`tandem serve --model DIR --colocated 1`, docs/diffusion.md), gets the same greedy prompt several times,
streamed and not, while sampled requests keep the server busy; every answer must be the same tokens, and each
response must say which decoding mode ran (`usage.dllm_chunk`: block for the greedy ones, elastic for the load).

`serve`, `serve_dllm` and `greedy_under_load` are what tests/test_docs_serve.py drives; `PROBES` is the chaos
suite's."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.bench.chaos import ChaosContext, Outcome
from tandem.bench.serve_process import serve_subprocess

DOC_ARGS = ("--colocated", "1")        # docs/diffusion.md's `tandem serve --model DIR --colocated 1`
GREEDY_PROMPT = "words:"               # random words: one token a step, where window sizes matter most
REPEATS = 10                           # greedy requests compared
MAX_TOKENS = 64
LOAD_CLIENTS = 3                       # threads sending sampled requests back to back meanwhile
LOAD_PROMPTS = ("copy: abc def ->", "reverse: kkh ->", "sort: bca ->", "words: x", "count: aab ->")
LOAD_TEMPERATURE = 0.8
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0


@contextlib.contextmanager
def serve(args: Sequence[str], workdir: Path, timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """`tandem serve ARGS` on a free port of 127.0.0.1 until the block ends (tandem.bench.serve_process); yields its
    base URL once /health answers 200."""
    workdir.mkdir(parents=True, exist_ok=True)
    with serve_subprocess(list(args), workdir / "serve.log", timeout_s=timeout_s) as (url, _):
        yield url


def serve_dllm(model: Path, workdir: Path, extra: Sequence[str] = ()):
    """The docs' diffusion command, `tandem serve --model MODEL --colocated 1 [extra]`, as `serve` runs it."""
    return serve(["--model", str(model), *DOC_ARGS, *extra], workdir)


@dataclass
class GreedyRun:
    """What the greedy requests got and what ran beside them."""

    outputs: list[list[int]] = field(default_factory=list)   # each greedy request's token ids
    modes: list[str | None] = field(default_factory=list)    # each greedy response's usage.dllm_chunk
    busy: list[int] = field(default_factory=list)            # load requests in flight when each greedy one was sent
    load_done: int = 0                                       # load requests answered 200
    load_failed: int = 0                                     # load requests answered otherwise
    load_modes: set[str | None] = field(default_factory=set)

    def distinct(self) -> int:
        """How many different outputs the greedy requests got."""
        return len({tuple(o) for o in self.outputs})


def _completion(client: httpx.Client, url: str, model: str, body: dict, stream: bool) -> tuple[list[int], str | None]:
    """One completion's token ids and usage.dllm_chunk, streamed or not (RuntimeError on a non-200)."""
    body = dict(body, model=model, return_token_ids=True)
    if not stream:
        r = client.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        d = r.json()
        return d["choices"][0]["token_ids"], d["usage"].get("dllm_chunk")
    ids: list[int] = []
    mode = None
    body.update(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as s:
        if s.status_code != 200:
            raise RuntimeError(f"{s.status_code}: {s.read()[:200]!r}")
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                ids += c.get("token_ids") or []
            if chunk.get("usage"):
                mode = chunk["usage"].get("dllm_chunk")
    return ids, mode


def greedy_under_load(url: str, repeats: int = REPEATS, prompt: str = GREEDY_PROMPT, max_tokens: int = MAX_TOKENS,
                      clients: int = LOAD_CLIENTS, body: dict | None = None) -> GreedyRun:
    """Send `prompt` greedily `repeats` times (streamed and not, alternately, one after another) while `clients`
    threads send sampled requests back to back; the run ends when the greedy requests have; `body`: more fields of
    every greedy request."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    run = GreedyRun()
    stop = threading.Event()
    lock = threading.Lock()
    in_flight = [0]

    def load(k: int) -> None:
        with httpx.Client() as client:
            i = k
            while not stop.is_set():
                p = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
                i += 1
                with lock:
                    in_flight[0] += 1
                try:
                    _, mode = _completion(client, url, model, {"prompt": p, "max_tokens": 48,
                                                               "temperature": LOAD_TEMPERATURE}, stream=i % 2 == 0)
                    with lock:
                        run.load_done += 1
                        run.load_modes.add(mode)
                except (RuntimeError, httpx.HTTPError):
                    with lock:
                        run.load_failed += 1
                finally:
                    with lock:
                        in_flight[0] -= 1
    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        with httpx.Client() as client:
            while in_flight[0] < min(clients, 1):        # the load is running before the first greedy request
                time.sleep(0.01)
            for i in range(repeats):
                with lock:
                    run.busy.append(in_flight[0])
                ids, mode = _completion(client, url, model, dict({"prompt": prompt, "max_tokens": max_tokens,
                                                                  "temperature": 0}, **(body or {})), stream=i % 2 == 1)
                run.outputs.append(ids)
                run.modes.append(mode)
    finally:
        stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S)
    return run


def probe_greedy_is_reproducible_under_load(ctx: ChaosContext) -> list[Outcome]:
    """The docs' diffusion command; REPEATS greedy requests for one prompt among sampled load: one output, every
    greedy response reporting block decoding and the load elastic windows."""
    attack = f"{REPEATS} greedy {GREEDY_PROMPT!r} requests (streamed and not) among {LOAD_CLIENTS} sampled clients"
    if ctx.dllm_model is None:
        return [Outcome(attack, "identical outputs", "skipped: no diffusion checkpoint given", True)]
    with serve_dllm(ctx.dllm_model, ctx.workdir / "dllm-repro") as url:
        run = greedy_under_load(url)
    lengths = sorted({len(o) for o in run.outputs})
    return [
        Outcome(attack, "one output, token for token",
                f"{run.distinct()} distinct (lengths {lengths}); load in flight at each send {run.busy}, "
                f"{run.load_done} load requests answered", run.distinct() == 1 and min(run.busy) > 0),
        Outcome("usage.dllm_chunk of those responses", "block on every one (auto: greedy requests decode whole blocks)",
                f"{sorted(set(map(str, run.modes)))}", set(run.modes) == {"block"}),
        Outcome("usage.dllm_chunk of the sampled load", "elastic (auto: sampled requests keep Optimus's windows)",
                f"{sorted(map(str, run.load_modes))}, {run.load_failed} failed",
                run.load_modes == {"elastic"} and run.load_failed == 0),
    ]


PROBES = [probe_greedy_is_reproducible_under_load]

__all__ = ["DOC_ARGS", "PROBES", "GreedyRun", "greedy_under_load", "probe_greedy_is_reproducible_under_load", "serve",
           "serve_dllm"]
