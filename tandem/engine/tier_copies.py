"""The engine's side of the host KV tier: the core's KVCopy actions carried out beside the steps, on two copy threads
(one per direction, in order, as the core's link model has it), their ends reported back to the core on the step
thread (the core is not thread-safe), and the tier's counters for /metrics.

Under tensor parallelism every rank keeps its own heads' host pool (as its swap space) and copies its share beside
its own steps on copy threads of its own (parallel/rank_tier.py): the driver starts a step's new copies on every rank
with one group command that does not wait, each rank reports each copy's end on its notice pipe, and the driver hands
a copy to the core only once every rank has ended it: done when every rank's share is done, failed (the core
recomputes) when any rank's failed.

A step never reads a block a copy is still writing: the core does not schedule a sequence whose KV is coming back;
`check` asserts it on every step planned while such copies are in flight.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem.core.host_tier import KVCopy
from tandem.engine.host_pool import GIB, CopyFault, CopyLanes, HostKVPool, host_memory_available

log = logging.getLogger("tandem.engine")
FAULT_ENV = "TANDEM_FAIL_KV_COPIES"     # fault injection: the next N host-tier copies raise on the copy thread
HOST_TIER_COUNTERS = ("offload_bytes", "write_bytes", "prefetch_bytes", "load_bytes", "failed_copies",
                      "gpu_hit_tokens", "cpu_hit_tokens", "late_rounds", "late_us")


def _env_faults() -> int:
    """How many copies FAULT_ENV says to fail (0 unless it holds a count)."""
    raw = os.environ.get(FAULT_ENV, "")
    try:
        return max(0, int(raw or 0))
    except ValueError:
        log.warning("%s=%r is not a count of copies: ignored", FAULT_ENV, raw)
        return 0


@dataclass
class _Shares:
    """A copy's shares still running, by rank (the driver is rank 0), and whether every ended one was done."""

    copy: KVCopy
    left: set[int]
    ok: bool = True
    why: list[str] = field(default_factory=list)


def host_link(one_s: float, per_block_s: float, block_size: int) -> Callable[[int], float]:
    """The core's host-link cost: seconds to copy n positions one way, from the pool's measured probe."""
    def link_s(tokens: int) -> float:
        return one_s + per_block_s * max(0, -(-tokens // block_size) - 1)
    return link_s


class TierRunner:
    """Runs one worker's host-tier copies on copy threads and hands their ends to the core."""

    def __init__(self, tier, pool: HostKVPool, kv_caches: list[torch.Tensor], clock: Callable[[], float],
                 fail_copies: int | None = None, group=None) -> None:
        self.tier, self.pool, self.kv_caches, self.clock = tier, pool, kv_caches, clock
        self.group = group                              # a tensor-parallel worker's other ranks (their shares)
        self.fail_copies = _env_faults() if fail_copies is None else fail_copies
        self.counters: dict[str, int] = dict.fromkeys(HOST_TIER_COUNTERS, 0)
        self.inflight: dict[int, KVCopy] = {}
        self.to_gpu: dict[int, KVCopy] = {}             # block -> the copy writing it
        self.ended: collections.deque = collections.deque()   # (copy, ok), once every rank's share ended
        self.on_end: Callable[[], None] = lambda: None  # the shell's wake-up (thread-safe), set by the runtime
        self._late: dict[str, float] = {}               # session -> when its round began waiting for its KV
        self._back: dict[str, int] = {}                 # session -> tokens brought back before its round began
        self._waited: dict[str, bool] = {}              # ... and whether that round waited for them (timed then)
        self._counted: set[int] = set()                 # copies in flight a round's hits already counted
        self._woken = threading.Event()                 # set at every copy's end (an idle engine waits on it)
        self._shares: dict[int, _Shares] = {}           # copy id -> its shares still running (copy threads, notices)
        self._gone: set[int] = set()                    # ranks whose notice pipe ended (exited): their shares fail
        self._lock = threading.Lock()
        self._lanes = CopyLanes("tandem-kv-copy", self._run_one)
        if group is not None:
            group.listen(self._notice)

    # ---------------------------------------------------------------- step thread
    def start(self, copies: list[KVCopy]) -> None:
        """Hand the core's new copies to the copy threads (slots mapped here, on the step thread); under tensor
        parallelism every rank's share starts too, with one group command that does not wait for them."""
        orders = []
        ranks = set(range(1 if self.group is None else self.group.size))
        for c in copies:
            try:
                blocks, slots = self.pool.plan(c, self.tier.host)
            except Exception as e:  # noqa: BLE001 - a copy that cannot run is a failed copy: the core recomputes
                log.error("host-tier copy %d (%s) cannot run: %s", c.id, c.kind.value, e)
                self.inflight[c.id] = c
                self.ended.append((c, False))
                continue
            self.inflight[c.id] = c
            if not c.kind.to_host:
                for b in blocks:
                    self.to_gpu[b] = c
            with self._lock:
                self._shares[c.id] = _Shares(c, ranks - self._gone, ok=not (self._gone & ranks))
            self._lanes.put(c.kind.to_host, (c, blocks, slots))
            orders.append((c.id, c.kind.to_host, blocks, slots))
        if orders and self.group is not None:
            self.group.send("tier_copies", orders)

    def waiting_on(self, copy_id: int) -> set[int]:
        """The ranks (0: the driver) whose share of a copy has not ended yet (none: ended or unknown)."""
        with self._lock:
            shares = self._shares.get(copy_id)
            return set(shares.left) if shares is not None else set()

    def rank_hooks(self, rank: int, fail: int = 0, hold: bool | None = None) -> None:
        """Test hooks on tensor-parallel rank `rank` (>= 1): its next `fail` shares of copies fail; hold=True holds
        its shares before they start until hold=False."""
        assert self.group is not None and 1 <= rank < self.group.size
        self.group.send("tier_hooks", rank, fail, hold)

    def compare(self, blocks: list[int], slots: list[int]) -> list[tuple[bool, float]]:
        """Per rank (the driver first): whether its host slots[i] equal its GPU blocks[i] bit for bit, and the sum
        of those slots' values (a check for tests and debugging, run on the step thread)."""
        from tandem.engine.parallel.rank_tier import compare, gather_objects
        mine = compare(self.pool, self.kv_caches, blocks, slots)
        if self.group is None:
            return [mine]
        group = self.group
        group.send("tier_compare", list(blocks), list(slots))
        return group.run(lambda: gather_objects(group.size, mine))

    def poll(self) -> bool:
        """Report the copies that ended to the core (on_copy_done / on_copy_failed); True if any did."""
        if not self.ended:
            return False
        now = self.clock()
        tier, counters, bb = self.tier, self.counters, self.pool.block_bytes
        while self.ended:
            c, ok = self.ended.popleft()
            self.inflight.pop(c.id, None)
            if not c.kind.to_host:
                for b in c.blocks:
                    if self.to_gpu.get(b) is c:
                        del self.to_gpu[b]
            if ok:
                counters[c.kind.value + "_bytes"] += -(-c.tokens // self.pool.block_size) * bb
                tier.on_copy_done(c.id, now)
            else:
                counters["failed_copies"] += 1
                tier.on_copy_failed(c.id, now)
            if not c.kind.to_host:
                self._came_back(c, ok, now)
        return True

    def _came_back(self, c: KVCopy, ok: bool, now: float) -> None:
        """A copy back to the GPU ended: its tokens count for the session's next round (unless the round already
        counted them), and a round waiting for it learns how late it was."""
        sid = c.session_id
        counted = c.id in self._counted
        self._counted.discard(c.id)
        began = self._late.pop(sid, None)
        if not ok:
            return
        if not counted:
            self._back[sid] = self._back.get(sid, 0) + c.tokens
        if began is not None:
            self.counters["late_rounds"] += 1
            self.counters["late_us"] += int(max(0.0, now - began) * 1e6)
            if not counted:
                self._waited[sid] = True

    def round_begins(self, seq, history: int, now: float) -> None:
        """A round begins on `history` resident (or arriving) tokens: count its prefix hits by tier and, when its KV
        is still on its way back from the host tier, time how late it is."""
        if seq is None:
            self.counters["gpu_hit_tokens"] += history
            return
        self.round_waits(seq, now)
        sid, c = seq.session_id, seq.loading
        if c is not None:                                # planned or in flight: the round waits for it
            back = c.tokens
            self._counted.add(c.id)
            self._back.pop(sid, None)
            self._waited.pop(sid, None)
        else:
            back = self._back.pop(sid, 0)
            if back and not self._waited.pop(sid, False):
                self.counters["late_rounds"] += 1        # back before the round asked: found in time, 0 s late
        cpu = min(history, back)
        self.counters["cpu_hit_tokens"] += cpu
        self.counters["gpu_hit_tokens"] += history - cpu

    def round_waits(self, seq, now: float) -> None:
        """A round of `seq` begins: if its KV is still on its way back, it waits from now."""
        if seq.loading is not None:
            self._late.setdefault(seq.session_id, now)

    def check(self, plan, core) -> None:
        """Assert that no sequence the step runs reads or writes a block a copy is still bringing back."""
        if plan is None or not self.to_gpu:
            return
        tables = core.blocks.tables
        sids = [t.session_id for t, _ in plan.prefill] + [s.session_id for s in plan.decode]
        for sid in sids:
            seq = core.seqs.get(sid)
            table = tables.get(seq, ()) if seq is not None else ()
            bad = [b for b in table if b in self.to_gpu]
            assert not bad, f"session {sid!r} is scheduled on blocks {bad} still in flight from the host tier"

    def busy(self) -> bool:
        """Copies in flight or ended and not reported yet."""
        return bool(self.inflight or self.ended)

    def due(self, now: float) -> bool:
        """Whether the core's tier wants a schedule call now: ended or planned copies, idle sessions to decide, a
        wake time."""
        tier = self.tier
        return bool(self.ended or tier.copies or tier.undecided or tier.wake_at <= now)

    def wait(self, timeout_s: float) -> None:
        """Block until a copy ends (or `timeout_s`): an engine with nothing to run but KV on its way back."""
        if not self.ended:
            self._woken.wait(timeout_s)
        self._woken.clear()

    def gauges(self) -> dict[str, float]:
        """Host tier occupancy: fraction and bytes in use, capacity bytes."""
        host = self.tier.host
        return {"usage": host.usage, "bytes": host.used * self.pool.block_bytes,
                "capacity_bytes": host.capacity_blocks * self.pool.block_bytes}

    def close(self) -> None:
        self._lanes.close()

    # ---------------------------------------------------------------- copy threads
    def _run_one(self, item: tuple[KVCopy, list[int], list[int]]) -> None:
        self._share_ended(item[0].id, 0, self._copy(*item))

    def _copy(self, c: KVCopy, blocks: list[int], slots: list[int]) -> str:
        """Carry out the driver's share of one copy here: "" when done, else why it failed (an injected fault or
        any error)."""
        try:
            if self.fail_copies > 0:
                self.fail_copies -= 1
                raise CopyFault(f"injected failure of host-tier copy {c.id} ({FAULT_ENV})")
            with torch.inference_mode():
                self.pool.copy(self.kv_caches, c.kind.to_host, blocks, slots)
        except Exception as e:  # noqa: BLE001 - reported to the core, which recomputes
            log.warning("host-tier copy %d (%s of %s) failed: %s", c.id, c.kind.value, c.session_id, e)
            return str(e) or type(e).__name__
        return ""

    def _notice(self, rank: int, notice) -> None:
        """A rank's notice (the group's listener thread): a share of a copy ended there; None: the rank exited, its
        shares still running fail."""
        if notice is None:
            with self._lock:
                self._gone.add(rank)
                running = [cid for cid, s in self._shares.items() if rank in s.left]
            for cid in running:
                self._share_ended(cid, rank, f"rank {rank} exited")
            return
        from tandem.engine.parallel.rank_tier import NOTICE
        if notice[0] == NOTICE:
            self._share_ended(notice[1], rank, notice[2])

    def _share_ended(self, copy_id: int, rank: int, why: str) -> None:
        """One rank's share of a copy ended ("" when done): the copy ends once every rank's share has, done only
        when every share is."""
        with self._lock:
            shares = self._shares.get(copy_id)
            if shares is None or rank not in shares.left:
                return
            shares.left.discard(rank)
            if why:
                shares.ok = False
                shares.why.append(f"rank {rank}: {why}")
            if shares.left:
                return
            del self._shares[copy_id]
            if self.group is not None and not shares.ok:
                log.warning("host-tier copy %d failed (%s)", copy_id, "; ".join(shares.why))
            self.ended.append((shares.copy, shares.ok))
        self._woken.set()
        self.on_end()


def check_host_memory(gib: float, device: torch.device) -> None:
    """ValueError (one line) when a host tier of `gib` GiB would not fit in the machine's available memory."""
    want = int(gib * GIB)
    have = host_memory_available(device)
    if want > have:
        raise ValueError(f"--kv-offloading-size {gib:g} GiB exceeds the {have / GIB:.1f} GiB of host memory "
                         f"available{' (pinned)' if device.type == 'cuda' else ''}")



def host_tier_setup(config, runner, sched, role: str, spec) -> tuple[HostKVPool | None, Callable[[int], float] | None]:
    """The host pool of a tiered policy's decode or co-located worker (kv_offloading_size GiB over its ranks) and the
    core's host-link cost measured on it; (None, None) for a worker without a tier. EngineError-worthy problems
    (no room in host memory) raise ValueError with one line."""
    from tandem.policy.task import PREFILL
    if not spec.tiered or role == PREFILL or not sched.kv_offloading_size:
        return None, None
    check_host_memory(sched.kv_offloading_size, runner.device)
    blocks = sched.host_tier_blocks(runner.kv_block_bytes, config.tensor_parallel_size)
    if blocks < 1:
        return None, None                           # the core's factory refuses it with its own message
    if runner.group is not None:                    # each rank's own heads, as its swap space
        runner.group.send("tier_alloc", blocks)
    pool = HostKVPool(runner.kv_caches, blocks, config.block_size)
    one, per_block = pool.probe(runner.kv_caches)
    log.info("host KV tier: %d blocks (%.1f MiB), copies %.0f us + %.1f us per block (%.2f GB/s)", blocks,
             blocks * pool.block_bytes / (1 << 20), one * 1e6, per_block * 1e6, pool.block_bytes / per_block / 1e9)
    pool.link_one_s, pool.link_block_s = one, per_block
    return pool, host_link(one, per_block, config.block_size)


def nominal_t_pre(runner, max_len: int) -> Callable[[int, int], float]:
    """A prefill estimate for a tiered engine given none (the offline engine): the checkpoint's nominal CPU roofline
    (tandem.perf.nominal), which its host tier weighs against a copy back when a round asks for offloaded KV."""
    from tandem.perf.nominal import checkpoint_params, nominal_cost_model
    mc = runner.model_config
    params = checkpoint_params(mc.vocab_size, mc.hidden_size, mc.num_hidden_layers, mc.intermediate_size)
    cost = nominal_cost_model(params, mc.num_hidden_layers, mc.hidden_size,
                              runner.kv_block_bytes // runner.block_size, max_len)
    return lambda h, n: cost.t_pre(h, n, 1)
