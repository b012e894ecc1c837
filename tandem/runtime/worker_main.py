"""The worker process: an LLMEngine of one role behind a Link to the coordinator and a KV inbox for peers.

Started by the launcher as "tandem.runtime.worker_main:main". Engine steps run on a thread so the event
loop keeps receiving messages and sending heartbeats during long prefills; messages are applied between
steps only, so the engine is never touched by two threads at once.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import time

import msgspec

from tandem.runtime import messages as m
from tandem.runtime.launcher import WorkerEnv
from tandem.runtime.state_store import WorkerState, open_store
from tandem.runtime.transport import Codec
from tandem.runtime.worker_shell import WorkerShell

CODEC = Codec([*m.CONTROL, *m.UPSTREAM, *m.KV], frames={m.KVData: 1})   # a KV header without its bytes is dropped
KEEP_FRESH_S = 0.5         # during a step longer than this, the last state is re-published (re-stamped) this often
log = logging.getLogger("tandem.worker")


def _cache_config(engine) -> dict[str, str]:
    """The labels of vllm:cache_config_info for this worker's KV cache."""
    cfg = engine.config
    return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(engine.runner.num_blocks),
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "cache_dtype": str(engine.runner.kv_caches[0].dtype).removeprefix("torch.")}


def _kv_bytes_per_token(engine) -> int:
    mc = engine.model_config
    return int(engine.runner.kv_caches[0].element_size() * 2 * mc.num_hidden_layers * mc.num_key_value_heads
               * mc.head_dim)


async def main(env: WorkerEnv, *, role: str, engine_args: dict, state: str = "embedded", cluster: str = "default",
               publish_s: float = 0.02, perf: str | None = None, threads: int | None = None,
               drop_kv_sends: int = 0, kv_send_faults: list | None = None, step_sleep_s: float = 0.0) -> None:
    """Serve one worker until the coordinator says Shutdown (or dies: the launcher then ends this process).

    Fault injection (tests, docs/runtime.md): `drop_kv_sends=N` silently drops this worker's next N KV sends, as
    a lost transfer; `kv_send_faults` gives one entry per later KV send: "drop", a delay in seconds, or None;
    `step_sleep_s` makes every engine step that long slower (a loaded machine's long prefill step)."""
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    if threads:
        torch.set_num_threads(threads)
    from tandem.runtime.costs import serving_cost_model

    cost: list = []                                            # filled once the engine knows its KV layout
    engine = LLMEngine(EngineConfig(**engine_args), role=role, worker_id=env.worker_id,
                       t_pre=lambda h, n: cost[0].t_pre(h, n, 1), forward_events=True)
    # the queue estimates (AMPD Eq. 1-2, Alg. 2) use the cost model the coordinator routes with
    cost.append(serving_cost_model(engine.config.model, _kv_bytes_per_token(engine), engine.max_model_len, perf))
    store = open_store(state, cluster=cluster) if state != "embedded" else None
    inbox, outbox = env.inbox(CODEC, accept=tuple(m.KV)), env.outbox(CODEC)   # CURVE, the cluster's KV keys
    up: list = []
    peer: list = []
    q: asyncio.Queue = asyncio.Queue()

    def send_peer(addr: str, msg, *bufs, delay_s: float = 0.0) -> None:
        if delay_s > 0:                                        # fault injection: a slow transfer
            asyncio.get_running_loop().call_later(delay_s, lambda: (peer.append((addr, msg, bufs)),
                                                                    q.put_nowait(("wake", None, []))))
        else:
            peer.append((addr, msg, bufs))

    shell = WorkerShell(engine, env.worker_id, lambda msg, *b: up.append((msg, b)), send_peer,
                        drop_kv_sends=drop_kv_sends, kv_send_faults=kv_send_faults or (), step_sleep_s=step_sleep_s)

    async with env.link(CODEC) as link:
        async def read_link() -> None:
            while True:
                msg, bufs = await link.recv()
                await q.put(("ctl", msg, bufs))
                if link.stopping:
                    return

        async def read_inbox() -> None:
            while True:
                msg, bufs = await inbox.recv()
                await q.put(("kv", msg, [bytes(b) for b in bufs]))

        async def flush() -> None:
            while peer:
                addr, msg, bufs = peer.pop(0)
                await outbox.send(addr, msg, *bufs)
            while up:
                msg, bufs = up.pop(0)
                await link.send(msg, *bufs)

        last_pub = 0.0
        last_state: list = [None]                    # the last WorkerState published (read on the loop only)
        counted: dict[int, int] = {}                 # iteration tokens already reported
        rejected = [0, 0]                            # dropped frames, refused handshakes already reported

        async def publish(force: bool = False) -> None:
            nonlocal last_pub
            now = time.time()
            if not force and now - last_pub < publish_s:
                return
            last_pub = now
            st = WorkerState.from_core(engine.core, engine.clock(), kv_addr=inbox.address, published_s=now)
            last_state[0] = st
            await send_state(st)
            new = {k: n - counted.get(k, 0) for k, n in engine.stats.iteration_tokens.items() if n != counted.get(k, 0)}
            frames = inbox.rejected_frames + link.rejected_frames
            handshakes = inbox.rejected_handshakes
            if new or frames != rejected[0] or handshakes != rejected[1]:
                counted.update(engine.stats.iteration_tokens)
                await link.send(m.StepCounts(new, frames - rejected[0], handshakes - rejected[1]))
                rejected[:] = [frames, handshakes]

        async def send_state(st: WorkerState) -> None:
            if store is not None:
                store.publish(st)
            else:
                await link.send(m.Stats(st))

        async def keep_fresh() -> None:
            """While a step runs (on its thread, the engine's state must not be read), re-publish the last state
            with a fresh time: a long step is a busy worker, not a lost one (the view counts a worker whose state
            is older than its liveness limit, 2 s, as gone, and refuses requests when no decode worker is left)."""
            nonlocal last_pub
            while True:
                await asyncio.sleep(KEEP_FRESH_S)
                now = time.time()
                if last_state[0] is not None and now - last_pub >= KEEP_FRESH_S:
                    last_pub = now
                    try:
                        await send_state(msgspec.structs.replace(last_state[0], published_s=now))
                    except Exception as e:  # noqa: BLE001 - the next publish retries; the heartbeat is separate
                        log.warning("worker %d: could not re-publish its state: %s", env.worker_id, e)

        def step() -> None:
            shell.step()

        def handle(kind: str, msg, bufs) -> None:
            if kind == "died":
                raise RuntimeError("a message reader of this worker died") from msg
            if kind == "kv":
                if isinstance(msg, m.KVData):
                    try:
                        shell.on_kv(msg, bufs)
                    except Exception:  # noqa: BLE001 - a peer's bad payload must not stop this worker
                        log.exception("worker %d: dropped a KV message it could not apply (%s)", env.worker_id,
                                      msg.request_id)
            elif type(msg) in m.CONTROL:
                shell.on_control(msg)

        def reader_died(t: asyncio.Task) -> None:       # a reader that dies must end the worker, not go quiet
            if not t.cancelled() and t.exception() is not None:
                log.error("worker %d: %s failed: %r; exiting (the supervisor replaces this worker)", env.worker_id,
                          t.get_name(), t.exception())
                q.put_nowait(("died", t.exception(), []))

        tasks = [asyncio.create_task(read_link(), name="control reader"),
                 asyncio.create_task(read_inbox(), name="KV inbox reader"),
                 asyncio.create_task(keep_fresh(), name="state keep-alive")]
        for t in tasks:
            t.add_done_callback(reader_died)
        mc = engine.model_config
        await publish(force=True)
        await link.ready({"kv_address": inbox.address, "pid": os.getpid(), "role": role,
                          "capacity_tokens": engine.core.capacity_tokens, "max_model_len": engine.max_model_len,
                          "block_size": engine.config.block_size, "vocab_size": mc.vocab_size,
                          "kv_bytes_per_token": _kv_bytes_per_token(engine), "cache_config": _cache_config(engine)})
        deferred: collections.deque = collections.deque()      # messages waiting for the running step's end

        async def step_taking_early_messages() -> None:
            """One engine step on its thread. Meanwhile the control messages that may run beside the model
            (m.EARLY_CONTROL) are carried out as they arrive, until one arrives that must wait for the step's
            end: it and every later message wait, so messages still take effect in the order they came."""
            fut = asyncio.ensure_future(asyncio.to_thread(step))
            getter: asyncio.Future | None = None
            try:
                while True:
                    if getter is None and not deferred:
                        getter = asyncio.ensure_future(q.get())
                    waiting = {fut} if getter is None else {fut, getter}
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if getter is not None and getter in done:
                        item, getter = getter.result(), None
                        if item[0] == "ctl" and isinstance(item[1], m.EARLY_CONTROL):
                            handle(*item)
                            await flush()
                        else:
                            deferred.append(item)
                    if fut in done:
                        fut.result()
                        return
            finally:
                if getter is not None:
                    getter.cancel()                    # asyncio.Queue.get leaves the item queued when cancelled

        try:
            while not link.stopping:
                while deferred:
                    handle(*deferred.popleft())
                while not q.empty():
                    handle(*q.get_nowait())
                await flush()
                ran = engine.stats.steps
                if shell.has_work():
                    await step_taking_early_messages()
                    await flush()
                if engine.stats.steps == ran and q.empty() and not deferred:   # nothing ran: sleep
                    try:
                        item = await asyncio.wait_for(q.get(), timeout=max(publish_s, 0.05))
                        handle(*item)
                        await flush()
                    except asyncio.TimeoutError:
                        pass
                await publish()
        finally:
            for t in tasks:
                t.cancel()
            if store is not None:
                store.remove(env.worker_id)
                store.close()
            outbox.close()
            inbox.close()
