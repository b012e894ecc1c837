"""Sessions across rounds and their KV: a round opened on a session's resident KV, KV exported and imported for
prefill/decode disaggregation (engine/kv_transfer.py moves the tensors), and KV swapped to host memory and back."""
from __future__ import annotations

from typing import Callable

from tandem.core.admission import SessionBusyError, check_one_round, continues
from tandem.core.prefix_hash import extend_hashes
from tandem.core.types import FirstToken, PrefillTask, Swap
from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.kv_transfer import KVPayload
from tandem.engine.model_runner import ModelRunner
from tandem.engine.parallel.kv_stage import StagedKV
from tandem.engine.outputs import RequestOutput
from tandem.engine.request_state import Request, RequestTable, Session
from tandem.engine.step_executor import StepStats


class SessionKV:
    """Where each session's KV is and goes: rounds opened on it, remote prefills' KV in and out, swaps."""

    def __init__(self, config: EngineConfig, core, runner: ModelRunner, table: RequestTable,
                 clock: Callable[[], float], stats: StepStats, tier=None) -> None:
        self.config, self.core, self.runner, self.table, self.clock, self.stats = \
            config, core, runner, table, clock, stats
        self.tier = tier                                  # the host tier's copy runner (engine/tier_copies.py)
        self.inbox: dict[str, KVPayload | StagedKV] = {}  # request id -> KV received (or staged), not yet placed
        self.landing: dict[str, Request] = {}             # session -> remote request whose KV awaits blocks

    def open_round(self, sid: str, ids: list[int], full: bool, remote: bool, arrival_time: float | None,
                   max_tokens: int, slo: tuple[float, float] | None) -> tuple[Session, PrefillTask]:
        """The session a round extends (afresh when its conversation was rewritten, or every position must be
        computed) and the round's prefill task on its resident KV."""
        sessions = self.table.sessions
        sess = sessions.get(sid)
        try:
            check_one_round(sid, sess.request.request_id if sess is not None and sess.request is not None else None)
        except SessionBusyError as e:
            raise EngineError(str(e)) from None
        if full or (sess is not None and not continues(sess.tokens, ids)):
            self.core.release(sid)                   # rewritten, or every position must be computed: start afresh
            sess = None
        if sess is None:
            sess = sessions[sid] = Session()
        now = self.clock() if arrival_time is None else arrival_time
        sess.tokens = list(ids)
        if self.config.enable_prefix_caching:
            extend_hashes(sess.hashes, ids, self.config.block_size)
        else:
            sess.hashes = []
        n = len(ids)
        # a local round takes its prompt's cached prefix as history; a remote one keeps the history the
        # coordinator routed with (RoundBegun told it what begin_round below returns)
        hist = self.core.begin_round(sid, () if remote or full else sess.hashes, n, now)
        if self.tier is not None:
            self.tier.round_begins(self.core.seqs.get(sid), hist, now)
        wid = self.core.id
        task = PrefillTask(sid, sess.rounds, hist, n - hist, now, output_tokens=max_tokens, decode_worker=wid,
                           worker=wid, local=not remote, block_hashes=tuple(sess.hashes), full_prefill=full)
        if slo is not None:
            task.ttft_slo_s, task.itl_slo_s = slo
        return sess, task

    def begin_round(self, session_id: str, prompt_token_ids: list[int] | None = None) -> int:
        """Pin a session's resident KV for its next round; returns how many tokens of it are resident."""
        hashes: list[int] = []
        if prompt_token_ids and self.config.enable_prefix_caching:
            extend_hashes(hashes, prompt_token_ids, self.config.block_size)
        if self.tier is not None:                # copies that ended since the last step free their blocks first: a
            self.tier.poll()                     # round must not recompute for want of blocks a landed copy still held
        now = self.clock()
        resident = self.core.begin_round(session_id, hashes, len(prompt_token_ids or ()), now)
        if self.tier is not None:
            self.tier.round_waits(self.core.seqs[session_id], now)
        return resident

    def end_session(self, session_id: str) -> None:
        """Forget a session and free its KV (prefix-cached blocks stay reusable)."""
        sess = self.table.sessions.pop(session_id, None)
        if sess is not None and sess.request is not None:
            self.table.finish(sess.request, "abort", self.clock(), release=False)
        self.core.release(session_id)

    def cancel(self, req: Request) -> None:
        """Prefill role: drop a task and the KV it received."""
        self.table.requests.pop(req.request_id, None)
        self.table.task_req.pop(req.task, None)
        self.discard(req.request_id)
        self.core.cancel(req.task)

    def history_span(self, session_id: str, tokens: int) -> tuple[list[int], int, int]:
        """Decode role: (block table, start, end) of the first `tokens` positions of a resident session's KV."""
        seq = self.core.seqs.get(session_id)
        if seq is None or seq.num_tokens < tokens:
            have = 0 if seq is None else seq.num_tokens
            raise EngineError(f"session {session_id!r} has {have} tokens of KV here, {tokens} were asked for")
        return self.core.blocks.tables[seq], 0, tokens

    def export_history(self, session_id: str, tokens: int) -> KVPayload:
        """Decode role: the first `tokens` positions of a resident session's KV (a remote prefill's history)."""
        return self.runner.export_kv(*self.history_span(session_id, tokens))

    def receive_kv(self, request_id: str, payload: KVPayload | StagedKV) -> None:
        """Keep KV that arrived for a request until the coordinator says where it goes."""
        if request_id not in self.table.requests:
            self.runner.forget_kv(payload)
            raise EngineError(f"KV for unknown request {request_id!r}")
        self.discard(request_id)
        self.inbox[request_id] = payload

    def receive_staged(self, request_id: str, transfer: str, tokens: int, wait_s: float) -> StagedKV:
        """KV a peer sent rank to rank: every rank holds its heads (claimed, kept until placed; waiting at most
        wait_s) or KVTransferError and none keeps any."""
        if request_id not in self.table.requests:
            raise EngineError(f"KV for unknown request {request_id!r}")
        staged = self.runner.claim_kv(transfer, tokens, wait_s)
        self.receive_kv(request_id, staged)
        return staged

    def send_kv_ranks(self, purpose: str, session_id: str, request_id: str, tokens: int, transfer: str,
                      dst: list[str], part_tokens: int) -> tuple[int, int, dict[int, float] | None, int]:
        """A session's history ("history", its first `tokens` positions) or a task's new KV ("incremental") from
        every rank straight to the receiving ranks: (tokens sent, first token or -1, its logprobs, bytes)."""
        tok, lps = -1, None
        if purpose == "history":
            table, start, end = self.history_span(session_id, tokens)
        else:
            table, start, end, tok, lps = self.new_kv_span(request_id)
        sent = self.runner.send_kv_ranks(table, start, end, transfer, dst, part_tokens)
        return end - start, tok, lps, sent

    def discard(self, request_id: str) -> None:
        """Forget KV received for a request and not placed (a staged transfer on every rank too)."""
        payload = self.inbox.pop(request_id, None)
        if payload is not None:
            self.runner.forget_kv(payload)

    def on_history_ready(self, request_id: str) -> None:
        """Prefill role: place the history KV in the task's blocks and let the task run."""
        req = self.table.requests[request_id]
        payload = self.inbox.pop(request_id)
        self.runner.import_kv(self.core.blocks.tables[req.task], 0, payload)
        self.core.on_history_fetched(req.task, self.clock())

    def new_kv_span(self, request_id: str) -> tuple[list[int], int, int, int, dict[int, float] | None]:
        """Prefill role: (block table, start, end) of the KV this task computed, its first token and logprobs."""
        req = self.table.requests[request_id]
        t = req.task
        if req.first_token is None:
            raise EngineError(f"request {request_id!r} has not finished its prefill")
        tok, lps = req.first_token
        return self.core.blocks.tables[t], t.l_hist, t.l_hist + t.l_incr, tok, lps

    def export_new_kv(self, request_id: str) -> tuple[KVPayload, int, dict[int, float] | None]:
        """Prefill role: the KV this task computed, and the first token it sampled (with its logprobs)."""
        table, start, end, tok, lps = self.new_kv_span(request_id)
        return self.runner.export_kv(table, start, end), tok, lps

    def on_delivered(self, request_id: str) -> None:
        """Prefill role: the decode worker has the new KV: free it here."""
        req = self.table.requests.pop(request_id, None)
        if req is not None:
            self.table.task_req.pop(req.task, None)
            self.core.on_delivered(req.task, self.clock())

    def on_kv_arrived(self, request_id: str, first_token: int,
                      first_logprobs: dict[int, float] | None) -> list[RequestOutput]:
        """Decode role: a remote prefill's KV (already received) and first token are here: start decoding."""
        table = self.table
        req = table.requests.get(request_id)
        if req is None or req.finished:
            self.discard(request_id)
            return []
        now = self.clock()
        touched = {request_id: req}
        if table.append_token(req, first_token, first_logprobs, now):
            req.task.output_tokens = 1                       # the first token already ends the round
        self.landing[req.session_id] = req
        self.core.on_kv_received(req.task, now)
        self.land_kv()
        table.on_events(self.core.drain(), now, touched)
        return table.collect(touched)

    def make_local(self, request_id: str) -> None:
        """Decode role: a remote round whose KV did not come is prefilled here instead (recompute)."""
        req = self.table.requests.get(request_id)
        if req is None or req.finished or req.task.local:
            return
        self.discard(request_id)
        self.landing.pop(req.session_id, None)
        self.core.run_local(req.task, self.clock())

    def before_step(self) -> None:
        """What the core's last schedule asked of the KV: its swaps carried out, received KV placed."""
        if self.core.swaps:
            self.swap(self.core.take_swaps())
        if self.landing:
            self.land_kv()

    def swap(self, swaps: list[Swap]) -> None:
        """Carry out the core's swaps in order on every rank: KV of preempted sequences to host memory and back, bit
        for bit."""
        self.runner.swap(swaps)
        self.stats.swapped_out_bytes = self.runner.swap_space.nbytes * self.config.tensor_parallel_size

    def land_kv(self) -> None:
        """Place received KV once the core has given the session its blocks (FirstToken of a remote round)."""
        for ev in self.core.events:
            if isinstance(ev, FirstToken) and ev.session_id in self.landing:
                req = self.landing.pop(ev.session_id)
                payload = self.inbox.pop(req.request_id)
                seq = self.core.seqs[req.session_id]
                self.runner.import_kv(self.core.blocks.tables[seq], seq.num_tokens - payload.num_tokens, payload)

    def cache_config(self) -> dict[str, str]:
        """The labels of vllm:cache_config_info for this engine's KV cache and swap space."""
        cfg, core = self.config, self.core
        return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(self.runner.num_blocks),
                "num_cpu_blocks": str(core.cfg.swap_blocks), "preemption_mode": core.cfg.preemption_mode.value,
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "cache_dtype": str(self.runner.kv_caches[0].dtype).removeprefix("torch.")}
