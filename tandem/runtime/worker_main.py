"""The worker process: an LLMEngine of one role behind a Link to the coordinator and a KV inbox for peers.

Started by the launcher as "tandem.runtime.worker_main:main". Engine steps run back to back on their own thread
(WorkerShell.run), as vLLM's engine core busy loop; the event loop receives messages, hands them to the shell
(carried out at once or at the running step's end, under the shell's lock), and sends what the steps produced,
beside the model's run, so sending and publishing stay off the step path.
"""
from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
import threading
import time

from tandem.runtime import messages as m
from tandem.runtime.launcher import WorkerEnv, mark_startup, startup_marks
from tandem.runtime.state_store import WorkerState, open_store
from tandem.runtime.transport import Codec, PeerUnreachable, TransportError
from tandem.runtime.worker_shell import WorkerShell

CODEC = Codec([*m.CONTROL, *m.UPSTREAM, *m.KV], frames={m.KVData: 1})   # a KV header without its bytes is dropped
KEEP_FRESH_S = 0.5         # an unchanged state (a long step) is re-published this often
STOP_WAIT_S = 5.0          # at shutdown, how long to wait for the running step to end
log = logging.getLogger("tandem.worker")


def _kv_bytes_per_token(engine) -> int:
    mc = engine.model_config
    return int(engine.runner.kv_caches[0].element_size() * 2 * mc.num_hidden_layers * mc.num_key_value_heads
               * mc.head_dim)


def open_rank_endpoints(engine, env: WorkerEnv, kv_cap: int) -> list[str]:
    """Every rank's KV endpoint (the cluster's KV keys, the inbox's host and frame cap), in rank order; none when one
    cannot open (then this worker's KV goes driver to driver, as it does between two tp=1 workers)."""
    from tandem.engine.kv_transfer import KVTransferError
    from tandem.runtime.rank_kv import endpoint_factory
    try:
        return engine.runner.open_kv_plane(endpoint_factory(env.auth, env.bind_host, kv_cap))
    except (KVTransferError, TransportError) as e:
        log.warning("worker %d: no rank-to-rank KV (%s); its KV goes through its driver", env.worker_id, e)
        return []


STEP_COUNTS = ("iteration_tokens", "dllm_commits", "dllm_chunks", "dllm_serve")   # StepStats counts sent as deltas

async def main(env: WorkerEnv, *, role: str, engine_args: dict, state: str = "embedded", cluster: str = "default",
               publish_s: float = 0.02, perf: str | None = None, threads: int | None = None,
               drop_kv_sends: int = 0, kv_send_faults: list | None = None, step_sleep_s: float = 0.0,
               drop_control: list[str] | None = None, kv_part_bytes: int | None = None, rank_kv: bool = True,
               kv_claim_wait_s: float | None = None) -> None:
    """Serve one worker until the coordinator says Shutdown (or dies: the launcher then ends this process).

    Fault injection (tests, docs/runtime.md): `drop_kv_sends=N` silently drops this worker's next N KV sends, as
    a lost transfer; `kv_send_faults` gives one entry per later KV send: "drop", a delay in seconds, or None;
    `step_sleep_s` makes every engine step that long slower (a loaded machine's long prefill step);
    `drop_control` names coordinator messages (e.g. ["AddRequest"]) whose next one is lost, once per entry.
    `kv_part_bytes` is the most KV payload one message carries (None: kv_transfer.KV_PART_BYTES; a longer transfer
    goes in parts); the KV inbox caps its frames at the largest such message of this deployment. `rank_kv`: give
    every rank a KV endpoint (KV then moves rank to rank with workers of another degree); else KV keeps to the
    driver path. `kv_claim_wait_s`: how long a rank-to-rank transfer's ranks have to hold their heads once its
    control message is in (None: kv_ranks.CLAIM_WAIT_S); "partial" in `kv_send_faults` sends a rank-to-rank transfer's
    parts all to the receiver's first rank."""
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.kv_transfer import KV_PART_BYTES, kv_bytes_per_token, kv_message_max_bytes, kv_part_tokens
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.memory_profile import memory_report

    if threads:
        torch.set_num_threads(threads)
    from tandem.runtime.costs import serving_cost_model
    mark_startup("imported")

    cost: list = []                                            # filled once the engine knows its KV layout
    tp = int(engine_args.get("tensor_parallel_size", 1))
    engine = LLMEngine(EngineConfig(**engine_args), role=role, worker_id=env.worker_id,
                       t_pre=lambda h, n: cost[0].t_pre(h, n, tp), forward_events=True)
    # the queue estimates (AMPD Eq. 1-2, Alg. 2) use the cost model the coordinator routes with
    cost.append(serving_cost_model(engine.config.model, _kv_bytes_per_token(engine), engine.max_model_len, perf,
                                   tps=(tp,)))
    mark_startup("model_loaded")          # weights, KV pool, and whatever the engine warms up (CUDA graphs)
    # the model's modules and startup objects out of the cyclic GC (as the serving process and vLLM's engine core
    # do): a full collection otherwise walks them all, in the middle of some step
    gc.collect()
    gc.freeze()
    store = open_store(state, cluster=cluster) if state != "embedded" else None
    # the largest KV message of this deployment caps every frame of the KV plane (the inbox drops a larger one unread,
    # before or after the handshake); every worker of a cluster has the same model, cache dtype and block size
    geometry = engine.runner.wire_geometry       # every KV head, whatever the TP degree
    bs, kv_part_bytes = engine.config.block_size, KV_PART_BYTES if kv_part_bytes is None else kv_part_bytes
    part_tokens = kv_part_tokens(bs, kv_bytes_per_token(*geometry), engine.max_model_len, kv_part_bytes)
    kv_cap = kv_message_max_bytes(bs, *geometry, engine.max_model_len, kv_part_bytes)
    inbox = env.inbox(CODEC, accept=tuple(m.KV), max_msg_bytes=kv_cap)     # CURVE, the cluster's KV keys
    rank_addrs = open_rank_endpoints(engine, env, kv_cap) if rank_kv else []
    outbox = env.outbox(CODEC, max_msg_bytes=kv_cap)
    up: collections.deque = collections.deque()        # to the coordinator, appended by both threads
    peer: collections.deque = collections.deque()      # to other workers' KV inboxes
    loop = asyncio.get_running_loop()
    kick = asyncio.Event()                             # something to send, or a thread/reader died
    died: list[BaseException] = []

    def wake() -> None:                                # from the step thread
        loop.call_soon_threadsafe(kick.set)

    def send_peer(addr: str, msg, *bufs, delay_s: float = 0.0) -> None:
        if delay_s > 0:                                        # fault injection: a slow transfer
            loop.call_soon_threadsafe(loop.call_later, delay_s,
                                      lambda: (peer.append((addr, msg, bufs)), kick.set()))
        else:
            peer.append((addr, msg, bufs))

    shell = WorkerShell(engine, env.worker_id, lambda msg, *b: up.append((msg, b)), send_peer,
                        drop_kv_sends=drop_kv_sends, kv_send_faults=kv_send_faults or (), step_sleep_s=step_sleep_s,
                        drop_control=drop_control or (), kv_part_tokens=part_tokens,
                        **({} if kv_claim_wait_s is None else {"kv_claim_wait_s": kv_claim_wait_s}))

    engine.runner.on_kv_staged(wake)                  # a rank-to-rank transfer may be complete: poll_kv below

    def run_steps() -> None:
        try:
            engine.runner.bind_calling_thread()        # the steps run on this thread's OpenMP team
            shell.run(wake)
        except BaseException as e:  # noqa: BLE001 - reported on the loop, which ends the worker
            log.exception("worker %d: its step thread failed; exiting (the supervisor replaces this worker)",
                          env.worker_id)
            loop.call_soon_threadsafe(lambda err=e: (died.append(err), kick.set()))

    async with env.link(CODEC) as link:
        mark_startup("connected")

        async def read_link() -> None:
            while not link.stopping:
                msg, _ = await link.recv()
                if type(msg) in m.CONTROL:
                    shell.post(msg)
                kick.set()

        async def read_inbox() -> None:
            while True:
                msg, bufs = await inbox.recv()
                if isinstance(msg, m.KVData):
                    shell.post(msg, bufs)                      # writable views of the frames: no copy
                    kick.set()
                elif isinstance(msg, m.KVRanked):              # the bytes came to the rank endpoints
                    shell.post(msg, [])
                    kick.set()

        async def flush() -> None:
            while peer:
                addr, msg, bufs = peer.popleft()
                try:
                    await outbox.send(addr, msg, *bufs)
                except PeerUnreachable as e:               # the receiver's core times the transfer out and recomputes
                    log.warning("worker %d: a KV send was not delivered: %s", env.worker_id, e)
                except TransportError as e:                # too large for the inboxes: fail its request now, clearly
                    log.error("worker %d: a KV send was refused: %s", env.worker_id, e)
                    up.append((m.WorkerFailure(getattr(msg, "request_id", ""), f"KV send refused: {e}"), ()))
            while up:
                msg, bufs = up.popleft()
                await link.send(msg, *bufs)

        last_pub = 0.0
        # the engine's cumulative step counts, by StepCounts field, as already reported
        counted: dict[str, dict] = {name: {} for name in (*STEP_COUNTS, "host_tier")}
        tier = engine.tier                           # the host KV tier's copy runner (None: no tier)
        rejected = [0, 0]                            # dropped frames, refused handshakes already reported
        kv_counted: dict[str, int] = {}              # KV bytes by path (engine.runner.kv_bytes keys), reported

        async def publish(changed: bool = True) -> bool:
            """The worker's state, read under the shell's lock (between steps or while the model runs): after a
            step or a message (`changed`), every `publish_s` at most; unchanged, re-stamped every KEEP_FRESH_S (a
            long step is a busy worker, not a lost one)."""
            nonlocal last_pub
            now = time.time()
            if now - last_pub < (publish_s if changed else KEEP_FRESH_S):
                return False
            last_pub = now
            with shell.lock:
                st = WorkerState.from_core(engine.core, engine.clock(), kv_addr=inbox.address, published_s=now,
                                           host_tier=tier.gauges() if tier is not None else None)
                counts = {name: dict(getattr(engine.stats, name)) for name in STEP_COUNTS}
                counts["host_tier"] = dict(tier.counters) if tier is not None else {}
                kv = engine.runner.kv_bytes()
                kv["driver"] += shell.driver_kv_bytes
            if store is not None:
                store.publish(st)
            else:
                await link.send(m.Stats(st))
            new = {name: {k: n - counted[name].get(k, 0) for k, n in c.items() if n != counted[name].get(k, 0)}
                   for name, c in counts.items()}
            frames = inbox.rejected_frames + link.rejected_frames
            handshakes = inbox.rejected_handshakes
            kv_new = {k: n - kv_counted.get(k, 0) for k, n in kv.items() if k not in kv_counted or n != kv_counted[k]}
            if any(new.values()) or kv_new or frames != rejected[0] or handshakes != rejected[1]:
                for name, c in counts.items():
                    counted[name].update(c)
                kv_counted.update(kv)
                await link.send(m.StepCounts(rejected_frames=frames - rejected[0],
                                             rejected_handshakes=handshakes - rejected[1], kv_bytes=kv_new, **new))
                rejected[:] = [frames, handshakes]
            return True

        def reader_died(t: asyncio.Task) -> None:       # a reader that dies must end the worker, not go quiet
            if not t.cancelled() and t.exception() is not None:
                log.error("worker %d: %s failed: %r; exiting (the supervisor replaces this worker)", env.worker_id,
                          t.get_name(), t.exception())
                died.append(t.exception())
                kick.set()

        tasks = [asyncio.create_task(read_link(), name="control reader"),
                 asyncio.create_task(read_inbox(), name="KV inbox reader")]
        for t in tasks:
            t.add_done_callback(reader_died)
        mc = engine.model_config
        await publish()
        mark_startup("ready")
        await link.ready({"startup": startup_marks(), "kv_address": inbox.address, "pid": os.getpid(), "role": role,
                          "capacity_tokens": engine.core.capacity_tokens, "max_model_len": engine.max_model_len,
                          "block_size": engine.config.block_size, "vocab_size": mc.vocab_size,
                          "dllm_block": engine.dllm.block if engine.dllm is not None else None,
                          "dllm_canvas": bool(engine.dllm is not None and engine.dllm.canvas),
                          "kv_bytes_per_token": _kv_bytes_per_token(engine), "cache_config": engine.cache_config(),
                          "kv_max_msg_bytes": kv_cap, "kv_part_tokens": part_tokens,
                          "tensor_parallel_size": engine.config.tensor_parallel_size,
                          "rank_pids": engine.runner.rank_pids, "rank_kv_addresses": rank_addrs,
                          "memory": memory_report(engine.runner.memory, engine.runner.kv_pool_bytes)})
        if engine.cpu_binding is not None:              # the loop on the worker's CPUs; the step thread binds its team
            from tandem.engine.omp_affinity import spread_calling_thread
            spread_calling_thread(engine.cpu_binding)
        stepper = threading.Thread(target=run_steps, name=f"tandem-worker-{env.worker_id}-steps", daemon=True)
        stepper.start()
        dirty = False                                   # a step ran or a message came since the last publish
        try:
            while not link.stopping:
                try:
                    await asyncio.wait_for(kick.wait(), timeout=publish_s)
                    dirty = True
                except asyncio.TimeoutError:
                    pass
                kick.clear()
                if shell.poll_kv():
                    dirty = True
                if died:
                    raise RuntimeError("this worker's step thread or a message reader died") from died[0]
                lost_rank = engine.runner.tp_failure()
                if lost_rank is not None:          # the group goes down as one worker; the supervisor replaces it
                    log.error("worker %d: %s; exiting (the supervisor replaces this worker and its ranks)",
                              env.worker_id, lost_rank)
                    raise RuntimeError(lost_rank)
                await flush()
                if await publish(dirty):
                    dirty = False
        finally:
            shell.stop()
            for t in tasks:
                t.cancel()
            await asyncio.to_thread(stepper.join, STOP_WAIT_S)
            # a tensor-parallel group's ranks stop with their worker: told to, or killed when a step still runs (its
            # collective holds the group) or a rank is gone
            engine.runner.close(force=stepper.is_alive())
            if store is not None:
                store.remove(env.worker_id)
                store.close()
            outbox.close()
            inbox.close()
