"""The worker's step thread (WorkerShell.run) and the I/O thread's hand-over (WorkerShell.post): which messages
are carried out beside a running model step and which wait for its end, in what order, and how the thread stops
and fails. A scripted engine stands in for LLMEngine so each step's start and end are set by the test."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from tandem.runtime import messages as m
from tandem.runtime.worker_shell import WorkerShell

WAIT_S = 10.0        # a bound on every wait below, so a broken shell fails the test instead of hanging it


class ScriptedEngine:
    """The LLMEngine calls a WorkerShell makes, logged; each model run waits for the test's `release`."""

    def __init__(self, steps: int, tp: int = 1) -> None:
        self.config = SimpleNamespace(tensor_parallel_size=tp)
        self.log: list[str] = []
        self.steps_left = steps
        self.running = threading.Semaphore(0)      # one release per model run entered
        self.release = threading.Event()
        self.fail: BaseException | None = None
        self.core_events: list = []
        self.core = SimpleNamespace(has_work=lambda: self.steps_left > 0)
        self.requests: dict[str, object] = {}
        self.tier = None                            # no host KV tier

    def tier_due(self) -> bool:
        return False

    def kv_loading(self, session_id: str) -> bool:
        return False

    def prepare_step(self):
        self.log.append("prepare")
        return SimpleNamespace(batch=object(), plan=object(), runs=True)

    def execute_step(self, prep):
        self.log.append("execute")
        self.running.release()
        assert self.release.wait(WAIT_S)
        self.release.clear()
        if self.fail is not None:
            raise self.fail
        return None

    def finish_step(self, prep, out):
        self.steps_left -= 1
        self.log.append("finish")
        return []

    def begin_round(self, session_id, prompt):
        self.log.append(f"begin {session_id}")
        return 0

    def add_request(self, request_id, *args, **kw):
        self.log.append(f"add {request_id}")
        self.requests[request_id] = object()

    def abort_request(self, request_id):
        self.log.append(f"abort {request_id}")

    def on_delivered(self, request_id):
        self.log.append(f"delivered {request_id}")

    def on_history_ready(self, request_id):
        self.log.append(f"history {request_id}")


def _shell(eng: ScriptedEngine, **faults):
    sent: list = []
    wakes = threading.Semaphore(0)
    shell = WorkerShell(eng, 0, lambda msg, *b: sent.append(msg), lambda *a, **k: None, **faults)
    errors: list[BaseException] = []

    def body():
        try:
            shell.run(wakes.release)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return shell, sent, thread, errors


def _add(rid: str) -> m.AddRequest:
    return m.AddRequest(rid, "s", [1, 2, 3], {"max_tokens": 1})


def test_early_messages_run_beside_the_model_and_the_rest_wait_for_the_step_end_in_order():
    """A BeginRound during a model run is carried out at once (its reply sent before the step ends); an Abort waits
    for the step's end, and an AddRequest after it waits too (it is early, but something waits before it), then
    both are carried out by the step thread in arrival order before the next step is planned."""
    eng = ScriptedEngine(steps=2)
    shell, sent, thread, errors = _shell(eng)
    assert eng.running.acquire(timeout=WAIT_S)
    assert shell.post(m.BeginRound("r1", "s")) is True
    assert [type(x) for x in sent] == [m.RoundBegun]             # answered during the step
    assert shell.post(m.Abort("r0")) is False
    assert shell.post(_add("r1")) is False
    assert eng.log == ["prepare", "execute", "begin s"]
    eng.release.set()
    assert eng.running.acquire(timeout=WAIT_S)                                # the second step runs
    assert eng.log == ["prepare", "execute", "begin s", "finish", "abort r0", "add r1", "prepare", "execute"]
    eng.release.set()
    shell.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors
    assert eng.log[-1] == "finish"


def test_under_tp_the_messages_that_move_kv_through_the_ranks_wait_for_the_step_end():
    """Protects a tensor-parallel group's one collective stream: at tp=2 a HistoryReady (its KV scattered to the
    ranks) during a model run waits for the step's end, while a Delivered (no rank involved) is carried out at once,
    as at tp=1."""
    eng = ScriptedEngine(steps=1, tp=2)
    shell, _, thread, errors = _shell(eng)
    assert eng.running.acquire(timeout=WAIT_S)
    assert shell.post(m.Delivered("r0")) is True
    assert shell.post(m.HistoryReady("r1")) is False
    assert eng.log == ["prepare", "execute", "delivered r0"]
    eng.release.set()
    shell.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors
    assert eng.log == ["prepare", "execute", "delivered r0", "finish", "history r1"]


def test_messages_are_carried_out_at_once_while_no_step_runs():
    """An idle worker carries out every message on arrival, whatever its kind."""
    eng = ScriptedEngine(steps=0)
    shell, _, thread, errors = _shell(eng)
    assert shell.post(m.Abort("r0")) is True
    assert shell.post(_add("r1")) is True
    assert eng.log == ["abort r0", "add r1"]
    shell.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors


def test_stop_ends_the_thread_after_the_running_step():
    """stop() during a model run lets that step finish (its outputs reported), then the thread returns."""
    eng = ScriptedEngine(steps=5)
    shell, _, thread, errors = _shell(eng)
    assert eng.running.acquire(timeout=WAIT_S)
    shell.stop()
    eng.release.set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors
    assert eng.log == ["prepare", "execute", "finish"]


def test_a_failing_model_run_ends_the_thread_with_its_error():
    """An exception in the model run is not swallowed: run() raises it (worker_main then ends the worker, and the
    supervisor replaces it)."""
    eng = ScriptedEngine(steps=3)
    eng.fail = RuntimeError("out of memory")
    shell, _, thread, errors = _shell(eng)
    assert eng.running.acquire(timeout=WAIT_S)
    eng.release.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert len(errors) == 1 and str(errors[0]) == "out of memory"


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


def test_an_audit_is_answered_beside_the_model_with_the_requests_held_and_delays_nothing_after_it():
    """An Audit during a model run is answered at once (Holding: the engine's requests, the running step's
    included), and an AddRequest after it still runs beside the model: an audit never costs a request a step."""
    eng = ScriptedEngine(steps=2)
    shell, sent, thread, errors = _shell(eng)
    assert eng.running.acquire(timeout=WAIT_S)
    assert shell.post(_add("r0")) is True
    assert shell.post(m.Audit(7)) is True
    assert shell.post(_add("r1")) is True
    assert sent == [m.Holding(7, ["r0"])]
    assert eng.log == ["prepare", "execute", "add r0", "add r1"]
    eng.release.set()
    assert eng.running.acquire(timeout=WAIT_S)
    eng.release.set()
    shell.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors


def test_drop_control_loses_the_next_message_of_each_named_type_once_and_refuses_unknown_names():
    """Fault injection (docs/runtime.md): drop_control=["AddRequest"] loses the next AddRequest only; a name that
    is not a control message is refused when the worker starts."""
    eng = ScriptedEngine(steps=0)
    shell, _, thread, errors = _shell(eng, drop_control=["AddRequest"])
    assert shell.post(_add("r0")) is False
    assert shell.post(_add("r1")) is True
    assert eng.log == ["add r1"]
    shell.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors
    with pytest.raises(ValueError, match=r"drop_control names control messages .*got \['AddRequests'\]"):
        WorkerShell(eng, 0, lambda *a: None, lambda *a, **k: None, drop_control=["AddRequests"])
