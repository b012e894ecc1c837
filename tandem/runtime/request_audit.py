"""Which requests each worker must hold, asked now and then, so a request lost on the way fails instead of waiting
forever (the coordinator's shell sends the questions and acts on the answers)."""
from __future__ import annotations

import itertools
from collections.abc import Iterable

from tandem.runtime import messages as m
from tandem.runtime.shell_request import ShellRequest

AUDIT_RETRY = 4            # an Audit unanswered for this many intervals is asked again (it may be what was lost)


class RequestAudit:
    """Ask each worker that must hold running requests which ones it holds (Audit). Messages between two
    processes arrive in order, so its answer (Holding) follows everything sent before the question and every
    output it sent before the answer: a request it should hold and does not was lost on the way (a dropped
    message, a worker that forgot it). One question per worker at a time (a worker busy with a long step answers
    after it), asked again after AUDIT_RETRY intervals unanswered (the question itself may be the message lost)."""

    def __init__(self, interval_s: float, now: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"the audit interval must be > 0 s, got {interval_s}")
        self.interval_s = interval_s
        self.next_s = now + interval_s
        self._ids = itertools.count()
        self._asked: dict[int, tuple[int, list[ShellRequest], float]] = {}   # worker -> (nonce, expected, when)

    def due(self, now: float) -> bool:
        """Whether it is time to ask again (and, if so, the next time after this one)."""
        if now < self.next_s:
            return False
        self.next_s = now + self.interval_s
        return True

    def questions(self, reqs: Iterable[ShellRequest], now: float) -> list[tuple[int, m.Audit]]:
        """The Audit to send each worker that must hold running requests and has no question outstanding."""
        expect: dict[int, list[ShellRequest]] = {}
        for req in reqs:
            if not req.done:
                for w in req.holders():
                    expect.setdefault(w, []).append(req)
        out = []
        for w, expected in expect.items():
            asked = self._asked.get(w)
            if asked is None or now - asked[2] > AUDIT_RETRY * self.interval_s:
                nonce = next(self._ids)
                self._asked[w] = (nonce, expected, now)
                out.append((w, m.Audit(nonce)))
        return out

    def lost(self, worker: int, msg: m.Holding, live: dict[str, ShellRequest]) -> list[ShellRequest]:
        """A worker's answer: the requests it should hold and does not (a stale answer names none)."""
        nonce, expected, _ = self._asked.get(worker, (None, [], 0.0))
        if nonce != msg.nonce:
            return []
        del self._asked[worker]
        held = set(msg.request_ids)
        return [req for req in expected if req.request_id not in held and not req.done
                and live.get(req.request_id) is req and worker in req.holders()]

    def forget(self, worker: int) -> None:
        """A worker is gone: its outstanding question with it."""
        self._asked.pop(worker, None)
