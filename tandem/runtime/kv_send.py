"""A worker's KV out to a peer (the coordinator's SendKV): rank to rank when both workers' ranks have KV endpoints
(each rank sends the receiving ranks their heads, engine/parallel/kv_ranks.py; the drivers exchange only KVRanked),
else driver to driver (the whole payload as KVData, in parts under the inboxes' frame cap). The driver path stays
the fallback: between two tp=1 workers, to a worker without rank endpoints, and when a rank-to-rank send cannot reach
the receiving ranks (then later transfers to those endpoints take it too)."""
from __future__ import annotations

import logging
import uuid
from typing import Callable

from tandem.engine.kv_transfer import KV_PART_BYTES, KVTransferError, kv_bytes_per_token, kv_part_tokens, split_kv
from tandem.engine.llm_engine import LLMEngine
from tandem.runtime import messages as m

log = logging.getLogger("tandem.worker")


class KVSender:
    """Carries out SendKV on one worker's engine; `send_peer(addr, msg, *frames, delay_s=0)` queues a message."""

    def __init__(self, engine: LLMEngine, worker_id: int, send_peer: Callable, wall: Callable[[], float],
                 faults: list, part_tokens: int | None = None) -> None:
        self.engine, self.id, self.send_peer, self.wall = engine, worker_id, send_peer, wall
        # fault injection, one entry per KV send from now on: "drop" (lost), "partial" (rank to rank: every part goes
        # to the receiver's first rank, which refuses the other ranks' heads), seconds (delayed), None (normal)
        for f in faults:
            if not (f is None or f in ("drop", "partial") or (isinstance(f, (int, float)) and f >= 0)):
                raise ValueError(f"a KV send fault is 'drop', 'partial', a delay in seconds >= 0 or None, got {f!r}")
        self.kv_send_faults = faults
        # the most tokens one KV message carries (None: as many whole blocks as fit in KV_PART_BYTES); a longer
        # transfer goes as parts in order, joined by the receiver, so every frame stays under the receiving inbox's cap
        self.kv_part_tokens = part_tokens
        self._unreachable: set[tuple[str, ...]] = set()      # rank endpoints a rank-to-rank send failed to reach
        self.driver_bytes = 0                                # KV payload bytes sent driver to driver

    def send(self, msg: m.SendKV) -> None:
        """Rank to rank when both workers' ranks have KV endpoints (not tp=1 to tp=1, and not to ranks this worker
        could not reach before); else, or when the ranks' parts cannot go out, driver to driver."""
        dst = tuple(msg.dst_rank_addrs)
        plane = self.engine.runner.kv_plane
        if not dst or plane is None or (plane.size == 1 and len(dst) == 1) or dst in self._unreachable:
            self._send_driver(msg)
            return
        fault = self._fault(msg)
        if fault == "drop":
            return
        try:
            self._send_ranked(msg, fault)
            return
        except KVTransferError as e:
            self._unreachable.add(dst)
            log.warning("worker %d: the %s KV of %s could not go rank to rank (%s); it goes through the drivers, as "
                        "will later transfers to worker %d", self.id, msg.purpose, msg.request_id, e, msg.dst_worker)
        self._send_driver(msg, fault)

    def _fault(self, msg: m.SendKV) -> str | float | None:
        fault = self.kv_send_faults.pop(0) if self.kv_send_faults else None
        if fault in ("drop", "partial"):                       # fault injection: the transfer is lost, or part of it
            log.warning("worker %d: %s the %s KV of %s (fault injection)", self.id,
                        "dropped" if fault == "drop" else "sent only part of", msg.purpose, msg.request_id)
        elif fault:                                            # fault injection: the transfer is slow
            log.warning("worker %d: delaying the %s KV of %s by %g s (fault injection)", self.id, msg.purpose,
                        msg.request_id, fault)
        return fault

    def _send_ranked(self, msg: m.SendKV, fault: str | float | None) -> None:
        """Every rank sends the receiving ranks their heads; then the control message alone, driver to driver."""
        transfer = f"{msg.request_id}/{msg.purpose}/{uuid.uuid4().hex[:12]}"
        sent_s = self.wall()
        dst = list(msg.dst_rank_addrs)
        if fault == "partial":
            dst = dst[:1] * len(dst)
        n, tok, lps, _ = self.engine.send_kv_ranks(msg.purpose, msg.session_id, msg.request_id, msg.tokens, transfer,
                                                   dst, self._part_tokens())
        head = m.KVRanked(msg.request_id, msg.purpose, self.id, transfer, n, sent_s, tok, lps)
        self.send_peer(msg.dst_addr, head, delay_s=fault if isinstance(fault, (int, float)) else 0.0)

    def _send_driver(self, msg: m.SendKV, fault: str | float | None | bool = False) -> None:
        """The whole payload from this driver to the receiving driver (KVData, in parts); `fault` already drawn, or
        False to draw it here."""
        eng = self.engine
        tok, lps = -1, None
        if msg.purpose == "history":
            payload = eng.export_history(msg.session_id, msg.tokens)
        else:
            payload, tok, lps = eng.export_new_kv(msg.request_id)
        parts = split_kv(payload, self._part_tokens())
        total = payload.num_tokens if len(parts) > 1 else 0
        sent_s = self.wall()
        fault = self._fault(msg) if fault is False else fault
        if fault == "drop":
            return
        fault = None if fault == "partial" else fault            # driver to driver: sent whole
        for offset, part in parts:
            head = m.KVData(msg.request_id, msg.purpose, self.id, part.num_tokens, part.dtype, list(part.shape),
                            sent_s, tok, lps, offset=offset, total_tokens=total)
            self.driver_bytes += part.nbytes
            if fault:
                self.send_peer(msg.dst_addr, head, part.buffer(), delay_s=float(fault))
            else:
                self.send_peer(msg.dst_addr, head, part.buffer())

    def _part_tokens(self) -> int:
        if self.kv_part_tokens is None:
            eng = self.engine
            self.kv_part_tokens = kv_part_tokens(eng.config.block_size,
                                                 kv_bytes_per_token(*eng.runner.wire_geometry),
                                                 eng.max_model_len, KV_PART_BYTES)
        return self.kv_part_tokens
