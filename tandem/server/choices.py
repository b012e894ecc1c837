"""Several choices for one request (`n > 1`), as vLLM's parallel sampling: one engine request per choice.

The first choice starts alone; the others start when its first output arrives, that is when the prompt's KV is
computed and its full blocks are in the prefix cache, so the other choices take the prompt's blocks from the cache
(shared, reference-counted) and compute only the tail that does not fill a block. A seeded request gives choice i
the seed `seed + i` (vLLM's rule), so the choices differ but the request stays reproducible. The streams of the
choices are merged as their outputs arrive, each chunk naming its choice's index.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams, shorten
from tandem.server import serving as sv
from tandem.server.errors import APIError
from tandem.server.metrics import RequestTimer
from tandem.server.protocol import PromptTokensDetails, Usage

MAX_N = 128                      # OpenAI's limit on choices per request


@dataclass
class Choice:
    """One choice's generation: its index, engine stream, first output and latency timer."""

    index: int
    gen: AsyncIterator[RequestOutput]
    first: RequestOutput
    timer: RequestTimer


def check_n(n: int, session_id: str | None) -> None:
    """400 naming n unless 1 ≤ n ≤ MAX_N, and for n > 1 in a session (a session's history is one conversation)."""
    if not 1 <= n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}, got {shorten(n)}", 400, "invalid_value", "n")
    if n > 1 and session_id is not None:
        raise APIError("n > 1 cannot be used with a session (a session continues one conversation)", 400,
                       "invalid_value", "n")


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s params: one sequence, seed shifted by the index when the request is seeded; prompt logprobs
    only on the first (they are the same for every choice, and asking for them forgoes the shared prefix)."""
    seed = params.seed + index if params.seed is not None else None
    plp = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=plp)


def _failed(out: RequestOutput) -> bool:
    return out.error is not None or (out.finished and out.outputs[0].finish_reason == "abort")


async def _start_one(state: sv.ServerState, request: Request, ids: list[int], params: SamplingParams, rid: str,
                     sid: str | None, text: str | None, index: int, received: float) -> Choice:
    gen = sv.start(state, ids, child_params(params, index), rid if index == 0 else f"{rid}-{index}", sid, text)
    timer = state.metrics.timer(received)
    first = await sv.first_output(request, gen)
    if _failed(first):
        timer.update(first)
        await sv.close(gen)
        raise sv.failure(state, first)
    return Choice(index, gen, first, timer)


async def start(state: sv.ServerState, request: Request, ids: list[int], params: SamplingParams, rid: str,
                sid: str | None, text: str | None, n: int, received: float) -> list[Choice]:
    """Start `n` choices (see the module docstring); any failure closes the started ones and raises. A started
    request's n goes to vllm:request_params_n."""
    choices = [await _start_one(state, request, ids, params, rid, sid, text, 0, received)]
    state.metrics.params_n.labels(state.metrics.model_name).observe(n)
    if n == 1:
        return choices
    rest = await asyncio.gather(*(_start_one(state, request, ids, params, rid, sid, text, i, received)
                                  for i in range(1, n)), return_exceptions=True)
    choices += [c for c in rest if isinstance(c, Choice)]
    error = next((e for e in rest if isinstance(e, BaseException)), None)
    if error is not None:
        await close_all(choices)
        raise error
    return choices


async def close_all(choices: list[Choice]) -> None:
    """Close every choice's generation (the backend aborts what is still running)."""
    for c in choices:
        with contextlib.suppress(Exception):
            await sv.close(c.gen)


async def collect_all(request: Request, choices: list[Choice]) -> list[RequestOutput]:
    """Every choice's finished output (a vanished client cancels them all)."""
    async def all_done() -> list[RequestOutput]:
        return list(await asyncio.gather(*(sv.collect(c.gen, c.first, c.timer.update) for c in choices)))
    try:
        return await sv.unless_gone(request, all_done())
    finally:
        await close_all(choices)


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) for every output of every choice, first outputs first, then as they arrive."""
    for c in choices:
        yield c.index, c.first
    pending = {asyncio.ensure_future(c.gen.__anext__()): c for c in choices if not c.first.finished}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                c = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield c.index, out
                if not out.finished:
                    pending[asyncio.ensure_future(c.gen.__anext__())] = c
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)     # a generator cannot close while it runs
        await close_all(choices)


def usage(prompt_len: int, outs: list[RequestOutput]) -> Usage:
    """The request's usage: the prompt once, every choice's completion tokens, the first choice's cached tokens."""
    done = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = outs[0].num_cached_tokens or outs[0].metrics.num_cached_tokens if outs else 0
    return Usage(prompt_tokens=prompt_len, completion_tokens=done, total_tokens=prompt_len + done,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 dllm_chunk=outs[0].dllm_chunk if outs else None)
