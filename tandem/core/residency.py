"""KV residency of one worker: which sessions and prefill tasks hold blocks of its pool, and the rules that move
them: admission under the watermark, prefix reuse, growth, preemption by recompute or swap, idle-KV retention and
eviction."""
from __future__ import annotations

import bisect
import math
from operator import attrgetter
from typing import Callable, Protocol, Sequence

from tandem.core.block_manager import BlockManager
from tandem.core.config import PreemptionMode, WorkerConfig
from tandem.core.laps_sched import LapsScheduler, LocalLaps
from tandem.core.tiering import TierManager
from tandem.core.types import (
    PREFILL, FetchHistory, PrefillTask, Seq, SeqState, SessionFailed, StepPlan, Swap, SwapKind,
)
from tandem.policy.dllm_serve import DllmServe
from tandem.policy.optimus.chunk import ChunkSizer
from tandem.policy.reorder import Picker


class WorkerHost(Protocol):
    """What KV residency and the step planners read and call of their worker core (tandem.core.worker.WorkerCore)."""

    id: int
    cfg: WorkerConfig
    role: str
    kv: KVResidency
    picker: Picker
    t_pre: Callable[[int, int], float]
    queue: list[PrefillTask]
    active: list[PrefillTask]
    seqs: dict[str, Seq]
    running: list[Seq]
    pending_kv: list[PrefillTask]
    events: list
    queued_est_s: float
    ctx_tokens: int
    wake_s: float
    steps: int
    laps: LapsScheduler | None
    local_laps: LocalLaps | None
    chunker: ChunkSizer | None
    dllm: DllmServe | None

    def submit(self, task: PrefillTask, now: float) -> None: ...
    def dequeue(self, task: PrefillTask) -> None: ...
    def stop_running(self, seq: Seq) -> None: ...
    def resume(self, seq: Seq) -> None: ...
    def start_decoding(self, seq: Seq, task: PrefillTask, now: float) -> None: ...
    def commit(self, plan: StepPlan, committed: dict[str, int] | None, stopped, now: float, hook=None) -> None: ...
    def schedule(self, now: float) -> StepPlan | None: ...


class KVResidency:
    """The block pool of one worker core, the sessions kept idle in it between rounds, and its swap space."""

    def __init__(self, host: WorkerHost, cfg: WorkerConfig, retention: float = 1.0) -> None:
        self.host = host
        self.cfg = cfg
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size)
        # sparse KV (dLLM-Serve, retention ρ < 1): a request of L positions keeps ⌈ρ·L⌉ of them, so the longest
        # sequence the pool holds is pool / ρ (what the coordinator checks rounds against)
        self.capacity_tokens = int(cfg.num_blocks * cfg.block_size / retention + 1e-9)
        self.watermark_blocks = int(cfg.watermark * cfg.num_blocks)
        self.idle: dict[str, Seq] = {}              # resident between rounds, oldest first (LRU)
        self.swapped: list[Seq] = []                # preempted by swap, in admission order (resumed first to last)
        self.swap_blocks = cfg.swap_blocks if cfg.preemption_mode is PreemptionMode.SWAP else 0   # host KV blocks
        self.swap_free = self.swap_blocks
        self.swaps: list[Swap] = []                 # KV copies for the shell to carry out before its next forward
        self.preempted = dict.fromkeys(PreemptionMode, 0)   # preemptions so far, by how they freed the KV
        self.tier: TierManager | None = None        # the host tier's rules (tandem/core/tiering.py), if it has one

    # ---------------------------------------------------------------- admission and prefix reuse
    def take_cached_prefix(self, seq: Seq, block_hashes: Sequence[int], prompt_tokens: int,
                           now: float | None = None) -> None:
        """A session with nothing resident takes the longest cached prefix of its prompt (whole diffusion blocks of
        it on a block-causal worker), leaving at least one token to compute; a host tier may load more of it."""
        bs = self.cfg.block_size
        blocks = self._cached(block_hashes, prompt_tokens)
        B = self.cfg.dllm_block
        if B and blocks:
            whole = len(blocks) * bs // B * B
            blocks = blocks[:whole // bs] if whole % bs == 0 else ()
        if blocks:
            self.blocks.share(seq, blocks)
            seq.num_tokens = len(blocks) * bs
            seq.cap = seq.num_tokens
        if self.tier is not None:
            self.tier.load_prefix(seq, block_hashes[:(prompt_tokens - 1) // bs], len(blocks),
                                  self.tier.now if now is None else now)

    def _cached(self, block_hashes: Sequence[int], tokens: int) -> Sequence[int]:
        """The cached blocks of the leading full blocks of `tokens` tokens, at least one token left out."""
        usable = block_hashes[:(tokens - 1) // self.cfg.block_size]
        return self.blocks.match_prefix(usable) if usable else ()

    def _reuse_prefix(self, seq: Seq, t: PrefillTask) -> None:
        """Take the cached blocks of the task's leading full blocks; at least one token is always computed."""
        blocks = self._cached(t.block_hashes, t.l_incr)
        if not blocks:
            return
        host = self.host
        self.blocks.share(seq, blocks)
        n = len(blocks) * self.cfg.block_size
        seq.num_tokens = n
        t.l_hist, t.l_incr, t.cached, t.hashed = n, t.l_incr - n, n, len(blocks)
        host.queued_est_s -= t.est_s
        t.est_s = host.t_pre(t.l_hist, t.l_incr)
        host.queued_est_s += t.est_s

    def register_blocks(self, t: PrefillTask, now: float = 0.0) -> None:
        """Publish the task's newly completed full blocks in the prefix cache."""
        full = min((t.first + t.done) // self.cfg.block_size, len(t.block_hashes))
        if full <= t.hashed:
            return
        owner = t if self.host.role == PREFILL else self.host.seqs.get(t.session_id)
        if owner is None or self.blocks.held(owner) < full:
            return
        for i in range(t.hashed, full):
            self.blocks.register(owner, i, t.block_hashes[i])
        if self.tier is not None:
            self.tier.registered(owner, t.hashed, t.block_hashes[t.hashed:full], now)
        t.hashed = full

    def admit(self, now: float) -> None:
        """Admit queued prefills, in the picker's order, while the step's budget, max_num_seqs and the pool (less
        the watermark the running sequences grow into) allow."""
        host, cfg = self.host, self.cfg
        if not host.queue:
            return                                   # nothing queued (most steps): skip the sums below
        budget = cfg.max_num_batched_tokens
        pending = sum(t.work - t.done for t in host.active)
        cap = cfg.max_num_seqs - len(host.running)
        local = host.local_laps
        queue = host.queue
        tier = self.tier
        while queue and pending < budget and len(host.active) < cap:
            if tier is not None and tier.inflight:       # tasks whose KV is still coming back are not candidates
                cand = [t for t in queue if not tier.waiting(t) and not (local is not None and local.holds(t))]
                if not cand:
                    break
                t = cand[host.picker.pick(cand, now)]
            elif local is not None and len(local.short):   # tasks AWD still holds are not candidates
                cand = [t for t in queue if not local.holds(t)]
                if not cand:
                    break
                t = cand[host.picker.pick(cand, now)]
            else:
                t = queue[host.picker.pick(queue, now)]
            if host.role == PREFILL:
                owner, need = t, t.l_hist + t.l_incr
            else:
                owner = host.seqs.get(t.session_id)
                if owner is None:                    # released while queued
                    host.dequeue(t)
                    continue
                if (t.block_hashes and not t.full_prefill and t.l_hist == 0 and owner.num_tokens == 0
                        and not self.blocks.held(owner)):
                    self._reuse_prefix(owner, t)
                need = owner.num_tokens + t.l_incr
            headroom = 0
            if host.role != PREFILL and -(-need // cfg.block_size) + self.watermark_blocks <= cfg.num_blocks:
                headroom = self.watermark_blocks     # room for the running sequences (and this one) to grow
            if not self.reserve(owner, need, now, preempt=False, headroom=headroom):
                self.never_fits(need, t, now)
                break
            self._start(t, now)
            pending += t.work

    def admit_task(self, t: PrefillTask, now: float) -> bool:
        """Admit one queued task of a prefill worker (LAPS picks which): hold memory for its history and new
        tokens, start reading its history; False when memory is short (it stays queued)."""
        if not self.reserve(t, t.l_hist + t.l_incr, now, preempt=False):
            self.never_fits(t.l_hist + t.l_incr, t, now)
            return False
        self._start(t, now)
        return True

    def _start(self, t: PrefillTask, now: float) -> None:
        """A queued task whose memory is held becomes active; a remote one starts reading its history."""
        host = self.host
        host.dequeue(t)
        t.start_s = now
        host.active.append(t)
        if host.role == PREFILL and t.first > 0:
            t.kv_ready = False
            host.events.append(FetchHistory(t, t.first))

    def never_fits(self, tokens: int, task: PrefillTask, now: float) -> bool:
        """Fail the task's session when its KV exceeds this worker's whole pool; True if it failed."""
        if tokens <= self.capacity_tokens:
            return False
        host = self.host
        host.events.append(SessionFailed(
            task.session_id, host.id, now,
            f"KV exceeds the worker's capacity: {tokens} tokens on a {host.role} worker of {self.capacity_tokens}"))
        if task in host.queue:
            host.dequeue(task)
        return True

    def retry_pending(self, now: float) -> None:
        """Remote KV that landed while memory was short starts decoding once its blocks are free."""
        host = self.host
        still = []
        for task in host.pending_kv:
            seq = host.seqs.get(task.session_id)
            if seq is None:
                continue
            if self.reserve(seq, seq.num_tokens + task.l_incr, now, preempt=False):
                host.start_decoding(seq, task, now)
            else:
                still.append(task)
        host.pending_kv = still

    def unstick(self, now: float) -> bool:
        """Nothing runs yet work waits for memory held by sessions waiting for their own prefill:
        drop those histories (their tasks recompute them; True), or fail the blocked session if even that
        is not enough."""
        host = self.host
        freed = False
        for t in reversed(host.queue):
            seq = host.seqs.get(t.session_id)
            if t.l_hist > 0 and seq is not None and seq.num_tokens == t.l_hist and self.blocks.held(seq) \
                    and seq.loading is None:
                if host.local_laps is not None:
                    host.local_laps.discard(t)           # a whole recompute now: no longer a short prefill
                self.drop(seq)
                host.queued_est_s -= t.est_s
                t.l_incr += t.l_hist
                t.l_hist = 0
                t.est_s = host.t_pre(0, t.l_incr)
                host.queued_est_s += t.est_s
                freed = True
        if freed:
            return True
        if self.tier is not None and self.tier.inflight:
            return False                             # a copy will land (and free or fill its blocks)
        waiting = {t.session_id for t in host.queue} | {t.session_id for t in host.pending_kv}
        if any(q.state is SeqState.PREFILL and sid not in waiting for sid, q in host.seqs.items()):
            return False                             # a remote prefill's KV is still on its way
        blocked = host.pending_kv[0] if host.pending_kv else host.queue[0]
        host.events.append(SessionFailed(
            blocked.session_id, host.id, now,
            f"KV memory exhausted: the {host.role} worker's {self.capacity_tokens} tokens are held by sessions "
            f"waiting for prefill; {blocked.l_hist + blocked.l_incr} more cannot be placed"))
        return False

    # ---------------------------------------------------------------- growth, retention, eviction
    def reserve(self, owner, tokens: int, now: float, preempt: bool, headroom: int = 0) -> bool:
        """Ensure `owner` holds blocks for `tokens` with `headroom` blocks left free, evicting idle KV and,
        if allowed, preempting."""
        blocks = self.blocks
        need = blocks.extra_blocks(owner, tokens) + headroom
        if blocks.num_free < need and not self._evict_idle(need, now):
            if not preempt or not self._preempt_for(need, owner, now):
                return False
        blocks.grow(owner, tokens)
        if isinstance(owner, Seq):
            owner.cap = blocks.held(owner) * self.cfg.block_size
        return True

    def kv_target(self, seq: Seq) -> int:
        """Positions whose KV slots a running sequence needs this step: its next tokens (AR, multi-token), or the
        whole active diffusion block up to max_tokens (a decoded position's K/V sit at its own position, which may
        lie anywhere in the block)."""
        B = self.cfg.dllm_block
        if not B:
            return seq.num_tokens + seq.commit_cap
        end = seq.num_tokens - seq.num_tokens % B + B
        limit = seq.num_tokens + seq.to_decode
        return end if end < limit else limit

    def grow(self, now: float) -> None:
        """Give every running sequence the slots of this step's query tokens (kv_target), preempting when the pool
        is short; a sequence that outgrew the whole pool fails."""
        host = self.host
        for seq in list(host.running):
            grow = self.kv_target(seq)
            if seq.state is SeqState.RUNNING and grow > seq.cap:
                if grow > self.capacity_tokens:      # outgrew the whole pool: no preemption helps
                    host.stop_running(seq)
                    self.drop(seq)
                    seq.state = SeqState.FAILED
                    host.events.append(SessionFailed(
                        seq.session_id, host.id, now, f"KV exceeds the worker's capacity: "
                        f"{grow} tokens on a {host.role} worker of {self.capacity_tokens}"))
                    continue
                if not self.reserve(seq, grow, now, preempt=True):
                    self.preempt(seq, now)           # could not free enough: preempt itself

    def drop(self, seq: Seq) -> None:
        """Free a session's blocks: nothing of it stays resident."""
        self.blocks.free(seq)
        seq.num_tokens, seq.cap = 0, 0

    def retain(self, seq: Seq, now: float) -> None:
        """A session between rounds stays resident, pinned for retain_s, then evictable least recently used first."""
        seq.state = SeqState.IDLE
        seq.retain_until = now + self.cfg.retain_s
        self.idle[seq.session_id] = seq
        if self.tier is not None:
            self.tier.on_idle(seq, now)

    def _evict_idle(self, need: int, now: float) -> bool:
        """Free idle sessions' KV, least recently used first, skipping pinned ones; True if enough (a host tier
        evicts by its own rule)."""
        if self.tier is not None:
            return self.tier.evict_idle(need, now)
        blocks = self.blocks
        wake = math.inf
        for sid in list(self.idle):
            if blocks.num_free >= need:
                break
            seq = self.idle[sid]
            if seq.retain_until > now:
                wake = min(wake, seq.retain_until)
                continue
            del self.idle[sid]
            self.drop(seq)
            seq.state = SeqState.EVICTED
        if blocks.num_free < need and wake < self.host.wake_s:
            self.host.wake_s = wake
        return blocks.num_free >= need

    def release(self, seq: Seq) -> None:
        """The session ended: its idle entry, its host copy if swapped out, its blocks go."""
        self.idle.pop(seq.session_id, None)
        if self.tier is not None:
            self.tier.forget(seq)
        if seq.state is SeqState.SWAPPED:            # its host copy is dropped
            self.swapped.remove(seq)
            self.swap_free += seq.swapped_blocks
            seq.swapped_blocks = 0
            self.swaps.append(Swap(SwapKind.DROP, seq.session_id, ()))

    # ---------------------------------------------------------------- preemption
    def _preempt_for(self, need: int, keep, now: float) -> bool:
        """Preempt until `need` blocks are free (decode / co-located workers, which alone grow sequences):
        admitted prefills first (latest first), as vLLM's running list ends with them, then decoding
        sequences, latest admitted first. Never `keep`."""
        host = self.host
        for t in reversed(list(host.active)):
            if self.blocks.num_free >= need:
                return True
            if host.seqs.get(t.session_id) is not keep:
                self._preempt_prefill(t, now)
        victims = sorted((s for s in host.running if s is not keep), key=attrgetter("order"), reverse=True)
        for seq in victims:
            if self.blocks.num_free >= need:
                break
            self.preempt(seq, now)
        return self.blocks.num_free >= need

    def _preempt_prefill(self, t: PrefillTask, now: float) -> None:
        """Stop an admitted local prefill and drop its session's KV: it restarts from token 0 when readmitted."""
        host = self.host
        host.active.remove(t)
        seq = host.seqs.get(t.session_id)
        if seq is not None:
            self.drop(seq)
            seq.preemptions += 1
        t.l_incr += t.l_hist
        t.l_hist, t.done, t.cached, t.hashed, t.start_s = 0, 0, 0, 0, None
        t.est_s = host.t_pre(0, t.l_incr)
        host.queue.insert(0, t)
        host.queued_est_s += t.est_s

    def preempt(self, seq: Seq, now: float) -> None:
        """vLLM's preemption: by swap when the swap space has room for the sequence's blocks (its KV is copied to
        host memory and back, unchanged), else by recompute (drop the KV, re-prefill the whole context first)."""
        host = self.host
        held = self.blocks.held(seq)
        host.stop_running(seq)
        seq.preemptions += 1
        if 0 < held <= self.swap_free:               # the shell copies its blocks out before they are reused
            self.swaps.append(Swap(SwapKind.OUT, seq.session_id, tuple(self.blocks.tables[seq])))
            self.blocks.free(seq)
            self.swap_free -= held
            seq.swapped_blocks, seq.cap, seq.state = held, 0, SeqState.SWAPPED
            self.preempted[PreemptionMode.SWAP] += 1
            bisect.insort(self.swapped, seq, key=attrgetter("order"))
            return
        self.preempted[PreemptionMode.RECOMPUTE] += 1
        tokens = seq.num_tokens
        self.drop(seq)
        seq.state = SeqState.PREFILL
        host.submit(PrefillTask(seq.session_id, -1, 0, tokens, now, decode_worker=host.id, recompute=True), now)

    def swap_in(self, now: float) -> None:
        """Resume swapped-out sequences, first admitted first, while the pool holds their blocks and the watermark
        (a sequence that needs more than the rest of the pool waives it)."""
        bs = self.cfg.block_size
        while self.swapped:
            seq = self.swapped[0]
            need = seq.swapped_blocks
            headroom = self.watermark_blocks if need + self.watermark_blocks <= self.cfg.num_blocks else 0
            if not self.reserve(seq, need * bs, now, preempt=False, headroom=headroom):
                return
            del self.swapped[0]
            self.swaps.append(Swap(SwapKind.IN, seq.session_id, tuple(self.blocks.tables[seq])))
            self.swap_free += need
            seq.swapped_blocks = 0
            self.host.resume(seq)

    def take_swaps(self) -> list[Swap]:
        """The KV copies planned since the last call, in order; the shell carries them out before its next forward
        (a block a swap-out frees may already belong to another sequence in the plan)."""
        out, self.swaps = self.swaps, []
        return out

    @property
    def swap_usage(self) -> float:
        """Fraction of the swap space holding preempted KV (vLLM's cpu_cache_usage_perc / 100; 0 without one)."""
        return 1.0 - self.swap_free / self.swap_blocks if self.swap_blocks else 0.0
