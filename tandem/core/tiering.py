"""The host tier's rules on one worker core: what happens to a session's KV when it goes idle (the policy's
IdleRule: keep, offload, drop), prefetches ahead of expected returns, loads on demand (a context or a cached
prefix), idle eviction by the tier's rule, and the outcome of every copy. Sans-I/O: copies are actions
(`take_copies`), their ends events (`on_copy_done`, `on_copy_failed`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

from tandem.core.host_tier import BlockRemoved, BlockStored, CopyKind, HostRun, HostTier, KVCopy, Medium, RunState
from tandem.core.types import PrefillTask, Seq, SeqState
from tandem.policy.kv_tiers import (
    EvictionKind, IdleAction, IdleContext, IdleDecision, IdleRule, IdleRuleKind, ToolTimeEstimator,
)


class Residency(Protocol):
    """What the tier reads and calls of its worker's KV residency (tandem.core.residency.KVResidency)."""

    cfg: object
    blocks: object
    host: object
    idle: dict[str, Seq]
    watermark_blocks: int

    def drop(self, seq: Seq) -> None: ...
    def reserve(self, owner, tokens: int, now: float, preempt: bool, headroom: int = 0) -> bool: ...

PREFETCH_LEAD_S = 1.0            # a prefetch is due this long (plus its copy time) before the expected return
PREFETCH_RETRY_S = 1.0           # a prefetch short of free blocks is tried again this much later
PREFETCH_PIN_S = 10.0            # prefetched KV stays pinned this long past the expected return
IDLE, OFFLOADED, PREFILL = SeqState.IDLE, SeqState.OFFLOADED, SeqState.PREFILL


@dataclass(slots=True)
class TierStats:
    """Counters of one worker's host tier."""

    offloads: int = 0            # session contexts copied out (incremental: only blocks the host lacked)
    offload_tokens: int = 0
    writes: int = 0              # prefix runs written through
    prefetches: int = 0          # contexts brought back ahead of the round
    prefetch_hits: int = 0       # rounds that found their prefetched KV resident
    loads: int = 0               # contexts or prefixes loaded because a round asked
    load_waits: int = 0          # rounds that waited for a copy in flight
    load_tokens: int = 0
    recomputes: int = 0          # rounds whose offloaded KV was recomputed instead (cheaper, or gone)
    drops: int = 0               # idle contexts dropped by the rule
    failed: int = 0              # copies that failed (their round recomputes; nothing is lost)
    host_evictions: int = 0


class TierCopies:
    """The host tier's state on one worker, its copies (planned, in flight, ended) and eviction of idle GPU copies;
    TierManager adds the decisions."""

    def __init__(self, res: Residency, host: HostTier, rule: IdleRule, link_s: Callable[[int], float],
                 t_pre: Callable[[int, int], float], estimator: ToolTimeEstimator | None = None) -> None:
        self.res = res
        self.host = host
        self.rule = rule
        self.link_s = link_s                     # seconds to copy n positions one way over the host link
        self.t_pre = t_pre
        self.est = estimator or ToolTimeEstimator()
        self.copies: list[KVCopy] = []           # planned, for the shell
        self.inflight: dict[int, KVCopy] = {}
        self._meta: dict[int, tuple] = {}        # copy id -> (session, covered tokens or block offset, runs, free)
        self._issued: dict[int, float] = {}
        self._ids = 0
        self._link_free = [0.0, 0.0]             # when each direction (0: to host, 1: to GPU) is expected free
        self.undecided: dict[str, Seq] = {}      # went idle, decided at the next tick (a tool hint may come first)
        self.hints: dict[str, float] = {}        # session -> the tool time announced for after its running round
        self.expiring: dict[str, Seq] = {}       # pinned, the rule asked again when the pin ends
        self.offloaded: dict[str, Seq] = {}      # GPU copy gone, host copy written
        self._expired: set[str] = set()          # expired while a copy out was in flight
        self.prefetch_at: dict[str, float] = {}
        self.wake_at = math.inf
        self.now = 0.0                           # the latest time an event brought (for callers without a clock)
        self.stats = TierStats()
        self.writes_prefixes = True
        self.res.blocks.removed = []             # the GPU prefix cache reports evicted hashes (BlockRemoved)

    def _eta(self, to_host: bool, tokens: int, now: float) -> float:
        """When a copy of `tokens` started now would end behind the copies already planned that way."""
        return max(now, self._link_free[0 if to_host else 1]) + self.link_s(tokens)

    def _issue(self, kind: CopyKind, seq_id: str, blocks, tokens: int, run, now: float, meta: tuple, first: int = 0,
               hashes: tuple[int, ...] = ()) -> KVCopy:
        end = self._eta(kind.to_host, tokens, now)
        self._link_free[0 if kind.to_host else 1] = end
        self._ids += 1
        c = KVCopy(self._ids, kind, seq_id, tuple(blocks), tokens, run, end - now, first, hashes)
        self.copies.append(c)
        self.inflight[c.id] = c
        self._meta[c.id] = meta
        self._issued[c.id] = now
        return c

    def take_copies(self) -> list[KVCopy]:
        """The copies planned since the last call, for the shell to run beside steps."""
        out, self.copies = self.copies, []
        return out

    def _readable(self, seq: Seq) -> HostRun | None:
        """The session's host run if it is written and still holds its context."""
        run = self.host.session(seq.session_id)
        bs = self.res.cfg.block_size
        if run is None or run.state is not RunState.READY or seq.host_tokens <= 0 \
                or run.nblocks * bs < seq.host_tokens:
            return None
        return run

    def _issued_at(self, c: KVCopy) -> float:
        return self._issued.get(c.id, 0.0)

    def _abandon(self, seq: Seq) -> None:
        """Stop waiting for the copy into the session's blocks: they go with the copy (freed when it ends)."""
        c = seq.loading
        blocks = self.res.blocks
        blocks.share(c, blocks.tables.get(seq, []))
        self.res.drop(seq)
        seq.loading = None

    def waiting(self, t: PrefillTask) -> bool:
        """Whether the task's session waits for its KV to come back (its prefill is not admitted yet)."""
        seq = self.res.host.seqs.get(t.session_id)
        return seq is not None and seq.loading is not None

    def evict_idle(self, need: int, now: float) -> bool:
        """Free idle sessions' GPU copies until `need` blocks are free, by the tier's rule (LRU, or latest expected
        return first), skipping pinned ones and ones being copied out; a context with a written host copy becomes
        OFFLOADED instead of lost. True if enough."""
        res = self.res
        blocks = res.blocks
        wake = math.inf
        order = list(res.idle.values())
        if self.host.eviction is EvictionKind.RETURN_TIME:
            order.sort(key=lambda s: -s.expect_s)
        for seq in order:
            if blocks.num_free >= need:
                break
            if seq.retain_until > now:
                wake = min(wake, seq.retain_until)
                continue
            if seq.copy_out is not None:
                continue
            self._evict(seq)
        if blocks.num_free < need and wake < res.host.wake_s:
            res.host.wake_s = wake
        self._publish_removed()
        return blocks.num_free >= need

    def _evict(self, seq: Seq) -> None:
        res = self.res
        del res.idle[seq.session_id]
        tokens = seq.num_tokens
        res.drop(seq)
        if seq.host_tokens >= tokens > 0 and self._readable(seq) is not None:
            seq.state = OFFLOADED
            self.offloaded[seq.session_id] = seq
        else:
            seq.state = SeqState.EVICTED
            self.prefetch_at.pop(seq.session_id, None)

    def _publish_removed(self) -> None:
        host = self.res.host
        gone = self.res.blocks.removed
        if gone:
            host.events.append(BlockRemoved(host.id, tuple(gone), Medium.GPU))
            self.res.blocks.removed = []
        hgone = self.host.take_removed()
        if hgone:
            host.events.append(BlockRemoved(host.id, tuple(hgone), Medium.CPU))

    def _end_copy(self, cid: int, now: float):
        """Forget copy `cid` (landed or failed) and free the blocks it held: (copy, seq, info, runs, extra), or None
        for a copy no longer tracked."""
        self.now = now
        c = self.inflight.pop(cid, None)
        if c is None:
            return None
        seq, info, runs, extra = self._meta.pop(cid)
        self._issued.pop(cid, None)
        self.res.blocks.free(c)
        return c, seq, info, runs, extra

    def on_copy_done(self, cid: int, now: float) -> None:
        """A copy landed: host runs become readable, loaded KV becomes usable, prefetched KV waits pinned."""
        ended = self._end_copy(cid, now)
        if ended is None:
            return
        c, seq, info, runs, extra = ended
        if c.kind is CopyKind.OFFLOAD:
            self.host.landed(c.run, now)
            seq.copy_out = None
            if seq.state is not SeqState.RELEASED:
                seq.host_tokens = info
                expired = seq.session_id in self._expired
                self._expired.discard(seq.session_id)
                if (extra or expired) and seq.state is IDLE and seq.session_id in self.res.idle:
                    self._evict(seq)             # InferCept's swap, or an expiry: the GPU copy goes now
        elif c.kind is CopyKind.WRITE:
            self.host.landed(c.run, now)
            self.res.host.events.append(BlockStored(self.res.host.id, c.run.hashes, Medium.CPU))
        else:
            for r in runs:
                self.host.unread(r)
            if seq.loading is c:
                seq.loading = None
                if extra:                        # a prefix load: its blocks join the GPU prefix cache
                    for i, h in enumerate(extra):
                        self.res.blocks.register(seq, info + i, h)
                    self.res.host.events.append(BlockStored(self.res.host.id, tuple(extra), Medium.GPU))
                elif seq.state is OFFLOADED:     # prefetched before the round: resident and pinned
                    seq.state = IDLE
                    seq.prefetched = True
                    seq.retain_until = max(seq.expect_s, now) + PREFETCH_PIN_S
                    self.res.idle[seq.session_id] = seq
        self._publish_removed()

    def on_copy_failed(self, cid: int, now: float) -> None:
        """A copy failed: a copy out leaves the GPU copy as it was (the host run is forgotten); a copy back frees
        its blocks and the session's round recomputes its context. No session is lost."""
        ended = self._end_copy(cid, now)
        if ended is None:
            return
        c, seq, info, runs, extra = ended
        self.stats.failed += 1
        if c.kind.to_host:
            self.host.abort(c.run)
            if seq is not None:
                seq.copy_out = None
            self._publish_removed()
            return
        for r in runs:
            self.host.unread(r)
        if seq.loading is not c:
            return                               # abandoned earlier: nothing waits for it
        seq.loading = None
        self.res.drop(seq)
        self.stats.recomputes += 1
        if seq.state is OFFLOADED:               # a prefetch: the host copy is still there for the round
            self.offloaded[seq.session_id] = seq
            return
        host = self.res.host
        for t in host.queue:
            if t.session_id == seq.session_id and t.l_hist > 0:
                host.queued_est_s -= t.est_s
                t.l_incr += t.l_hist
                t.l_hist, t.cached, t.hashed = 0, 0, 0
                t.est_s = host.t_pre(0, t.l_incr)
                host.queued_est_s += t.est_s

    def summary(self) -> dict:
        """The tier's counters and occupancy (a simulation report's per-worker entry)."""
        self.stats.host_evictions = self.host.evictions
        return {**asdict(self.stats), "host_capacity_blocks": self.host.capacity_blocks,
                "host_used_blocks": self.host.used}


class TierManager(TierCopies):
    """One worker's host tier and the rules that use it (built by tandem.core.factory.build_worker)."""

    def on_idle(self, seq: Seq, now: float) -> None:
        """A round ended: the session's KV waits for the rule, decided at the next tick (with the tool time
        announced for after this round, if any, else the learnt estimate)."""
        self.now = now
        sid = seq.session_id
        seq.idle_since = now
        seq.expect_s = now + self.est.expected(sid)
        seq.prefetched = False
        self.undecided[sid] = seq
        hint = self.hints.pop(sid, None)
        if hint is not None:
            self._known_return(seq, hint, now)

    def expect_return(self, sid: str, tool_s: float, now: float) -> None:
        """The coordinator knows the tool's time (the trace's tool_s, a client's): the next round comes tool_s
        after the end of the session's round, the one under way (or about to start) if any, else the one that
        just ended."""
        seq = self.res.host.seqs.get(sid)
        if seq is None or seq.idle_since < 0:
            self.hints[sid] = tool_s                 # for the running round's end (on_idle)
            return
        self._known_return(seq, tool_s, now)

    def _known_return(self, seq: Seq, tool_s: float, now: float) -> None:
        """The idle session's next round comes tool_s after its last round ended."""
        sid = seq.session_id
        old = seq.expect_s
        seq.expect_s = seq.idle_since + tool_s
        if sid in self.prefetch_at:
            self.prefetch_at[sid] = self._prefetch_time(seq)
        elif seq.state is IDLE and seq.retain_until == old and sid not in self.expiring:
            seq.retain_until = seq.expect_s          # pinned until the (estimated) return: now the known one
        self._rewake(now)

    def _context(self, seq: Seq, now: float, expired: bool) -> IdleContext:
        bs = self.res.cfg.block_size
        n = seq.num_tokens
        run = self.host.session(seq.session_id)
        have = run.nblocks if run is not None and seq.host_tokens else 0
        need = max(0, -(-n // bs) - have)
        return IdleContext(now, n, max(0.0, seq.expect_s - now), self._eta(False, n, now) - now,
                           self.t_pre(0, n), self.res.blocks.usage, self.res.host.ctx_tokens,
                           self.host.room(need, now, keep=run), expired)

    def _decide(self, seq: Seq, now: float, expired: bool) -> None:
        d = self.rule.decide(self._context(seq, now, expired))
        sid = seq.session_id
        if d.action is IdleAction.KEEP:
            seq.retain_until = d.pin_until
            if d.pin_until > now and self.rule.name is IdleRuleKind.TTL:
                self.expiring[sid] = seq
        elif d.action is IdleAction.OFFLOAD:
            seq.retain_until = 0.0
            if self._offload(seq, now, d) and d.prefetch:
                self.prefetch_at[sid] = self._prefetch_time(seq)
        else:
            self.stats.drops += 1
            self.res.idle.pop(sid, None)
            self.res.drop(seq)
            seq.state = SeqState.EVICTED

    def _prefetch_time(self, seq: Seq) -> float:
        return seq.expect_s - PREFETCH_LEAD_S - self.link_s(max(seq.num_tokens, seq.host_tokens))

    def _offload(self, seq: Seq, now: float, d: IdleDecision) -> bool:
        """Copy the blocks of the context the host lacks (the last partial block again); False if it cannot fit."""
        bs = self.res.cfg.block_size
        sid = seq.session_id
        table = self.res.blocks.tables.get(seq, [])
        if not table or seq.copy_out is not None:
            return False
        prev = self.host.session(sid)
        first = min(seq.host_tokens, prev.nblocks * bs) // bs if prev is not None else 0
        run = self.host.put_session(sid, len(table), now, seq.expect_s)
        if run is None:
            return False
        blocks = table[first:]
        c = self._issue(CopyKind.OFFLOAD, sid, blocks, seq.num_tokens - first * bs, run, now,
                        (seq, seq.num_tokens, (), d.free_gpu), first)
        self.res.blocks.share(c, blocks)         # the copy reads them: they stay allocated until it lands
        seq.copy_out = c
        self.stats.offloads += 1
        self.stats.offload_tokens += c.tokens
        return True

    def tick(self, now: float) -> None:
        """Decide for sessions that went idle, ask the rule again where a pin ran out, start due prefetches."""
        self.now = now
        if self.undecided:
            todo, self.undecided = list(self.undecided.values()), {}
            for seq in todo:
                if seq.state is IDLE:
                    self._decide(seq, now, False)
        if self.expiring:
            for sid, seq in list(self.expiring.items()):
                if seq.state is not IDLE:
                    del self.expiring[sid]
                elif seq.retain_until <= now:
                    del self.expiring[sid]
                    self._decide(seq, now, True)
        if self.prefetch_at:
            for sid, at in list(self.prefetch_at.items()):
                if at <= now:
                    self._prefetch(sid, now)
        self._rewake(now)

    def _rewake(self, now: float) -> None:
        w = math.inf
        for at in self.prefetch_at.values():
            if now < at < w:
                w = at
        for seq in self.expiring.values():
            if now < seq.retain_until < w:
                w = seq.retain_until
        self.wake_at = w

    def _prefetch(self, sid: str, now: float) -> None:
        """Bring an offloaded context back ahead of its round, with free blocks only (it evicts nothing)."""
        seq = self.offloaded.get(sid)
        if seq is None:                           # still resident (or gone): nothing to bring back
            if self.res.host.seqs.get(sid) is None or self.res.host.seqs[sid].state is not OFFLOADED:
                del self.prefetch_at[sid]
            return
        run = self._readable(seq)
        if run is None:
            del self.prefetch_at[sid]
            return
        res = self.res
        need = -(-seq.host_tokens // res.cfg.block_size)
        if res.blocks.num_free - res.watermark_blocks < need:
            retry = now + PREFETCH_RETRY_S
            if retry < seq.expect_s:
                self.prefetch_at[sid] = retry
            else:
                del self.prefetch_at[sid]
            return
        del self.prefetch_at[sid]
        del self.offloaded[sid]
        res.blocks.grow(seq, seq.host_tokens)
        self._load(seq, run, CopyKind.PREFETCH, now)
        self.stats.prefetches += 1

    def _load(self, seq: Seq, run: HostRun, kind: CopyKind, now: float) -> None:
        table = self.res.blocks.tables[seq]
        self.host.read(run, now)
        seq.num_tokens = seq.host_tokens
        seq.cap = len(table) * self.res.cfg.block_size
        seq.loading = self._issue(kind, seq.session_id, table, seq.host_tokens, run, now, (seq, 0, (run,), False))
        self.stats.load_tokens += seq.host_tokens

    def begin_round(self, seq: Seq, now: float) -> None:
        """The session's next round is here: learn the gap; KV in flight back is waited for or abandoned, KV only
        in the host tier is loaded or recomputed, whichever the cost model says is cheaper."""
        self.now = now
        sid = seq.session_id
        if seq.idle_since >= 0:
            self.est.observe(sid, now - seq.idle_since)
            seq.idle_since = -1.0
        self.undecided.pop(sid, None)
        self.expiring.pop(sid, None)
        self.prefetch_at.pop(sid, None)
        if seq.prefetched and seq.loading is None and seq.num_tokens:
            self.stats.prefetch_hits += 1
        seq.prefetched = False
        if seq.loading is not None:
            left = seq.loading.est_s - (now - self._issued_at(seq.loading))
            if left <= self.t_pre(0, seq.num_tokens):
                self.stats.load_waits += 1
                return
            self._abandon(seq)                    # recomputing is cheaper than waiting for the copy
            self.stats.recomputes += 1
            return
        if seq.state is not OFFLOADED:
            return
        self.offloaded.pop(sid, None)
        run = self._readable(seq)
        tokens = seq.host_tokens
        if run is None or self._eta(False, tokens, now) - now > self.t_pre(0, tokens) \
                or not self.res.reserve(seq, tokens, now, preempt=False):
            self.stats.recomputes += 1
            return
        self._load(seq, run, CopyKind.LOAD, now)
        self.stats.loads += 1
        self.stats.load_waits += 1

    def load_prefix(self, seq: Seq, hashes, cached_blocks: int, now: float) -> None:
        """After the GPU prefix cache gave `cached_blocks`, load the following blocks the host tier holds when that
        is cheaper than prefilling them (the round waits for the copy)."""
        bs = self.res.cfg.block_size
        m = self.host.match(hashes[cached_blocks:])
        if m <= 0:
            return
        tokens = m * bs
        if self._eta(False, tokens, now) - now > self.t_pre(cached_blocks * bs, tokens):
            return
        total = (cached_blocks + m) * bs
        if not self.res.reserve(seq, total, now, preempt=False):
            return
        runs = self.host.runs_of(hashes[cached_blocks:cached_blocks + m])
        for r in runs:
            self.host.read(r, now)
        table = self.res.blocks.tables[seq]
        seq.num_tokens = total
        seq.cap = len(table) * bs
        loaded = tuple(hashes[cached_blocks:cached_blocks + m])
        seq.loading = self._issue(CopyKind.LOAD, seq.session_id, table[cached_blocks:cached_blocks + m], tokens,
                                  None, now, (seq, cached_blocks, tuple(runs), loaded), hashes=loaded)
        self.stats.loads += 1
        self.stats.load_tokens += tokens

    def registered(self, owner, first: int, hashes, now: float) -> None:
        """Blocks first.. of `owner` were registered under `hashes` in the GPU prefix cache: publish them and write
        the ones the host tier lacks through to it."""
        host = self.res.host
        host.events.append(BlockStored(host.id, tuple(hashes), Medium.GPU))
        if not self.writes_prefixes:
            return
        new = [(i, h) for i, h in enumerate(hashes) if h not in self.host.by_hash]
        if not new:
            return
        run = self.host.put_prefix(tuple(h for _, h in new), now)
        if run is None:
            return
        table = self.res.blocks.tables[owner]
        blocks = [table[first + i] for i, _ in new]
        c = self._issue(CopyKind.WRITE, getattr(owner, "session_id", ""), blocks, len(blocks) * self.res.cfg.block_size,
                        run, now, (None, now, (), False))
        self.res.blocks.share(c, blocks)
        self.stats.writes += 1

    def expire(self, seq: Seq) -> None:
        """The coordinator's session TTL ran out while the session was idle: the GPU copy goes (once a copy out in
        flight lands), the host copy stays, subject to the tier's eviction; a prefetch may still bring it back."""
        sid = seq.session_id
        self.undecided.pop(sid, None)
        self.expiring.pop(sid, None)
        if seq.state is IDLE and sid in self.res.idle:
            if seq.copy_out is not None:
                self._expired.add(sid)
            else:
                self._evict(seq)
        self._publish_removed()

    def forget(self, seq: Seq) -> None:
        """The session ended: its host run goes (once its copies end), a copy into its blocks keeps them."""
        sid = seq.session_id
        for d in (self.undecided, self.expiring, self.offloaded, self.prefetch_at, self.hints):
            d.pop(sid, None)
        self.est.forget(sid)
        self.host.drop_session(sid)
        if seq.loading is not None:
            self._abandon(seq)
        self._rewake(self.now)

