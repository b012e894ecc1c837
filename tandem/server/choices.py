"""A request's generation on the backend, watched for a vanished client: its choices (`n > 1`, as vLLM's parallel
sampling: one engine request per choice) started, merged as they stream, or collected.

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
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from starlette.types import Receive

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.client import RequestError
from tandem.server.errors import APIError, ClientGone, as_api_error, failure
from tandem.server.metrics import RequestTimer
from tandem.server.state import ServerState
from tandem.server.streaming import close

T = TypeVar("T")


@dataclass
class Choice:
    """One choice's generation: its index, engine stream, first output and latency timer."""

    index: int
    gen: AsyncIterator[RequestOutput]
    first: RequestOutput
    timer: RequestTimer


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s params: one sequence, seed shifted by the index when the request is seeded; prompt logprobs
    only on the first (they are the same for every choice, and asking for them forgoes the shared prefix)."""
    seed = params.seed + index if params.seed is not None else None
    plp = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=plp)


def _failed(out: RequestOutput) -> bool:
    return out.error is not None or (out.finished and out.outputs[0].finish_reason == "abort")


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client went away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone()
    try:
        return task.result()
    except RequestError as e:
        raise as_api_error(e) from None


async def _first_output(request: Request, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output of a generation (add-time errors raise APIError; a vanished client raises ClientGone)."""
    try:
        return await unless_gone(request, gen.__anext__())
    except StopAsyncIteration:
        raise APIError("the backend returned no output", 500, "request_failed") from None
    except BaseException:
        await close(gen)
        raise


async def _start_one(state: ServerState, request: Request, ids: list[int], params: SamplingParams, rid: str,
                     sid: str | None, text: str | None, index: int, received: float,
                     tool_s: float | None = None) -> Choice:
    """Start one choice on the backend (errors surface on its first output)."""
    hint = {"tool_s": tool_s} if tool_s is not None else {}       # only backends with a host tier take it
    gen = state.client.generate(ids, child_params(params, index), rid if index == 0 else f"{rid}-{index}",
                                session_id=sid, prompt=text, **hint)
    timer = state.metrics.timer(received)
    first = await _first_output(request, gen)
    if _failed(first):
        timer.update(first)
        await close(gen)
        raise failure(state, first)
    return Choice(index, gen, first, timer)


async def start(state: ServerState, request: Request, ids: list[int], params: SamplingParams, rid: str,
                sid: str | None, text: str | None, n: int, received: float,
                tool_s: float | None = None) -> list[Choice]:
    """Start `n` choices (see the module docstring); any failure closes the started ones and raises. A started
    request's n goes to vllm:request_params_n."""
    choices = [await _start_one(state, request, ids, params, rid, sid, text, 0, received, tool_s)]
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
            await close(c.gen)


async def _collect(gen: AsyncIterator[RequestOutput], first: RequestOutput, on_output: Any) -> RequestOutput:
    """Drain a generation to its finished output, reporting each one to `on_output`."""
    out = first
    on_output(out)
    try:
        while not out.finished:
            out = await gen.__anext__()
            on_output(out)
    finally:
        await close(gen)
    return out


async def finish_all(state: ServerState, request: Request, choices: list[Choice]) -> list[RequestOutput]:
    """Every choice's finished output (a vanished client cancels them all); the failure of the first that failed."""
    async def all_done() -> list[RequestOutput]:
        return list(await asyncio.gather(*(_collect(c.gen, c.first, c.timer.update) for c in choices)))
    try:
        outs = await unless_gone(request, all_done())
    finally:
        await close_all(choices)
    failed = next((o for o in outs if _failed(o)), None)
    if failed is not None:
        raise failure(state, failed)
    return outs


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
