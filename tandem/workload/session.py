"""Sessions: multi-round conversations, the unit every tandem workload is made of."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn


class WorkloadError(ValueError):
    """A workload (trace file, generator argument) is malformed or invalid; the message says where."""


@dataclass(slots=True)
class SLO:
    """Per-session latency objectives: every round's TTFT and the session's mean ITL."""

    ttft_s: float
    itl_s: float


@dataclass(slots=True)
class Round:
    """One round: `input_tokens` new tokens are prefilled, then `output_tokens` are decoded."""

    input_tokens: int
    output_tokens: int
    tool_s: float = 0.0
    hash_ids: list[int] | None = None


@dataclass(slots=True)
class Session:
    """A multi-round conversation arriving at `arrival_s`; round k>0 appends to everything before it."""

    session_id: str
    arrival_s: float
    rounds: list[Round]
    slo: SLO | None = None
    block_size: int | None = None
    model: str | None = None
    messages: list | None = None
    extra: dict = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        """Context length after the last round: all inputs plus all outputs."""
        return sum(r.input_tokens + r.output_tokens for r in self.rounds)

    def first_prompt_hashes(self, block_size: int) -> tuple[int, ...]:
        """Chained hashes of the full `block_size`-token blocks of the first round's prompt, derived from its
        `hash_ids` (blocks of `self.block_size` tokens): equal hashes mean equal prefixes (prefix caching).

        Block j ends at token e = (j+1)*block_size, inside trace block i = ceil(e / self.block_size) - 1; the
        pair (hash_ids[i], offset of e in it) names the prefix [0, e) exactly."""
        r = self.rounds[0] if self.rounds else None
        if r is None or not r.hash_ids or not self.block_size:
            return ()
        tb = self.block_size
        covered = min(r.input_tokens, len(r.hash_ids) * tb)
        out = []
        for j in range(covered // block_size):
            e = (j + 1) * block_size
            i = -(-e // tb) - 1
            out.append(hash((r.hash_ids[i], e - i * tb)))
        return tuple(out)


# --------------------------------------------------------------------------- parsing

_SESSION_KEYS = ("session_id", "arrival_s", "rounds", "slo", "block_size", "model", "messages")
_ROUND_KEYS = ("input_tokens", "output_tokens", "tool_s", "hash_ids")
_SLO_KEYS = ("ttft_s", "itl_s")


def _fail(where: str, what: str) -> NoReturn:
    raise WorkloadError(f"{where}: {what}")


def _int(value: object, where: str, name: str, minimum: int) -> int:
    if type(value) is not int:  # bool is a subclass of int and is rejected here on purpose
        _fail(where, f"{name} must be an integer, got {_show(value)}")
    if value < minimum:
        _fail(where, f"{name} must be >= {minimum}, got {value}")
    return value


def _float(value: object, where: str, name: str, positive: bool) -> float:
    if type(value) is not float and type(value) is not int:
        _fail(where, f"{name} must be a number, got {_show(value)}")
    x = float(value)
    if not math.isfinite(x):
        _fail(where, f"{name} must be finite, got {x}")
    if positive and x <= 0.0:
        _fail(where, f"{name} must be > 0, got {value}")
    if x < 0.0:
        _fail(where, f"{name} must be >= 0, got {value}")
    return x


def _show(value: object) -> str:
    if value is None:
        return "null"
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


_INF = math.inf


def _parse_round(obj: object, where: str, k: int) -> Round:
    if type(obj) is dict:  # fast path for the common, valid round; anything unusual takes the slow path
        inp = obj.get("input_tokens")
        out = obj.get("output_tokens")
        tool = obj.get("tool_s", 0.0)
        if (
            type(inp) is int and type(out) is int and inp >= (k == 0) and out >= 1  # round 0 needs >= 1
            and (type(tool) is float or type(tool) is int) and 0 <= tool < _INF
            and "hash_ids" not in obj and len(obj) == 2 + ("tool_s" in obj)
        ):
            return Round(inp, out, float(tool), None)
    return _parse_round_checked(obj, where, k)


def _parse_round_checked(obj: object, where: str, k: int) -> Round:
    name = f"rounds[{k}]"
    if type(obj) is not dict:
        _fail(where, f"{name} must be an object, got {_show(obj)}")
    for key in obj:
        if key not in _ROUND_KEYS:
            _fail(where, f"{name} has unknown key {key!r} (allowed: {', '.join(_ROUND_KEYS)})")
    if "input_tokens" not in obj:
        _fail(where, f"{name}.input_tokens is missing")
    if "output_tokens" not in obj:
        _fail(where, f"{name}.output_tokens is missing")
    inp = _int(obj["input_tokens"], where, f"{name}.input_tokens", 1 if k == 0 else 0)
    out = _int(obj["output_tokens"], where, f"{name}.output_tokens", 1)
    tool = _float(obj.get("tool_s", 0.0), where, f"{name}.tool_s", False)
    hashes = obj.get("hash_ids")
    if hashes is not None:
        if type(hashes) is not list:
            _fail(where, f"{name}.hash_ids must be a list of integers, got {_show(hashes)}")
        for i, h in enumerate(hashes):
            if type(h) is not int:
                _fail(where, f"{name}.hash_ids[{i}] must be an integer, got {_show(h)}")
    return Round(inp, out, tool, hashes)


def _parse_slo(obj: object, where: str) -> SLO | None:
    if obj is None:
        return None
    if type(obj) is not dict:
        _fail(where, f"slo must be an object with ttft_s and itl_s, got {_show(obj)}")
    for key in obj:
        if key not in _SLO_KEYS:
            _fail(where, f"slo has unknown key {key!r} (allowed: {', '.join(_SLO_KEYS)})")
    for key in _SLO_KEYS:
        if key not in obj:
            _fail(where, f"slo.{key} is missing")
    return SLO(_float(obj["ttft_s"], where, "slo.ttft_s", True), _float(obj["itl_s"], where, "slo.itl_s", True))


def parse_session(obj: dict, where: str) -> Session:
    """Validate one decoded JSON object and build a Session; errors name `where` and the field."""
    if type(obj) is not dict:
        _fail(where, f"a session must be a JSON object, got {_show(obj)}")
    sid = obj.get("session_id")
    if type(sid) is not str or not sid:
        _fail(where, "session_id is missing" if sid is None else f"session_id must be a non-empty string, got {_show(sid)}")
    if "arrival_s" not in obj:
        _fail(where, "arrival_s is missing")
    arrival = _float(obj["arrival_s"], where, "arrival_s", False)
    raw_rounds = obj.get("rounds")
    if raw_rounds is None:
        _fail(where, "rounds is missing")
    if type(raw_rounds) is not list:
        _fail(where, f"rounds must be a list, got {_show(raw_rounds)}")
    if not raw_rounds:
        _fail(where, "rounds is empty (a session needs at least one round)")
    rounds = [_parse_round(r, where, k) for k, r in enumerate(raw_rounds)]
    slo = _parse_slo(obj.get("slo"), where)
    block_size = obj.get("block_size")
    if block_size is not None:
        block_size = _int(block_size, where, "block_size", 1)
    elif any(r.hash_ids is not None for r in rounds):
        _fail(where, "block_size is required when rounds carry hash_ids")
    model = obj.get("model")
    if model is not None and type(model) is not str:
        _fail(where, f"model must be a string, got {_show(model)}")
    messages = obj.get("messages")
    if messages is not None and type(messages) is not list:
        _fail(where, f"messages must be a list, got {_show(messages)}")
    extra = {k: v for k, v in obj.items() if k not in _SESSION_KEYS}
    return Session(sid, arrival, rounds, slo, block_size, model, messages, extra)


def round_to_dict(r: Round) -> dict:
    """One round as its JSON object; defaults (tool_s 0, no hash_ids) are left out."""
    d: dict = {"input_tokens": r.input_tokens, "output_tokens": r.output_tokens}
    if r.tool_s:
        d["tool_s"] = r.tool_s
    if r.hash_ids is not None:
        d["hash_ids"] = r.hash_ids
    return d


def session_to_dict(s: Session) -> dict:
    """One session as the JSON object of the trace format (extra keys merged at top level)."""
    d: dict = {"session_id": s.session_id, "arrival_s": s.arrival_s}
    if s.slo is not None:
        d["slo"] = {"ttft_s": s.slo.ttft_s, "itl_s": s.slo.itl_s}
    if s.block_size is not None:
        d["block_size"] = s.block_size
    if s.model is not None:
        d["model"] = s.model
    d["rounds"] = [round_to_dict(r) for r in s.rounds]
    if s.messages is not None:
        d["messages"] = s.messages
    for k, v in s.extra.items():
        if k in _SESSION_KEYS:
            raise WorkloadError(f"session {s.session_id!r}: extra key {k!r} collides with a trace field")
        d[k] = v
    return d


def _read_lines(path: str | os.PathLike) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WorkloadError(f"{path}: is a directory, not a JSONL file") from None
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read ({e.strerror})") from None


def load_sessions(path: str | os.PathLike) -> list[Session]:
    """Load a session trace (JSON Lines), validating every line; sorted by arrival_s (stable)."""
    loads = json.loads
    sessions: list[Session] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(_read_lines(path), 1):
        if not line or line.isspace():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = loads(line)
        except ValueError as e:  # json.JSONDecodeError
            msg = getattr(e, "msg", str(e))
            col = getattr(e, "colno", None)
            _fail(where, f"malformed JSON: {msg}" + (f" (column {col})" if col else ""))
        except RecursionError:
            _fail(where, "malformed JSON: nested too deeply")
        s = parse_session(obj, where)
        prev = first_line.setdefault(s.session_id, lineno)
        if prev != lineno:
            _fail(where, f"duplicate session_id {s.session_id!r} (first seen at line {prev})")
        sessions.append(s)
    if not sessions:
        raise WorkloadError(f"{path}: empty trace (no sessions)")
    sessions.sort(key=_arrival)
    return sessions


def _arrival(s: Session) -> float:
    return s.arrival_s


def dump_sessions(sessions: Iterable[Session], path: str | os.PathLike) -> None:
    """Write sessions as JSON Lines, refusing anything load_sessions would reject."""
    lines = []
    seen: set[str] = set()
    for i, s in enumerate(sessions):
        d = session_to_dict(s)
        parse_session(d, f"session #{i} ({s.session_id!r})")
        if s.session_id in seen:
            raise WorkloadError(f"session #{i}: duplicate session_id {s.session_id!r}")
        seen.add(s.session_id)
        try:
            lines.append(json.dumps(d, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise WorkloadError(f"session #{i} ({s.session_id!r}): not JSON-serialisable: {e}") from None
    if not lines:
        raise WorkloadError(f"{path}: refusing to write an empty trace")
    try:
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"{path}: cannot write ({e.strerror})") from None
