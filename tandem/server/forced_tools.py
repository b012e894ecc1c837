"""Forced tool calls (`tool_choice` "required" or a named function): the grammar that forces them, and the scanner
that turns the constrained output into OpenAI tool calls, streamed or whole.

vLLM's shapes: a named function constrains the output to the function's parameters schema, and the whole output
is the call's arguments; "required" constrains it to a JSON array of `{"name": <one of the tools>, "parameters":
<that tool's schema>}` objects (at least one; at most one when `parallel_tool_calls` is false), one call per item.

`ForcedCallScanner` reads the output as it grows and reports `CallDelta`s: a call's header (index, id, name) as
soon as its name is complete, then its arguments' text as it arrives, so a stream carries OpenAI's incremental
`tool_calls` deltas; the same scanner over a finished text gives the non-streaming calls, so both paths agree
token for token. An item whose keys do not come in the grammar's order is still reported, whole, when it closes.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tandem.engine.sampling_params import shorten
from tandem.engine.structured_output import StructuredOutput, StructuredOutputError
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest, Tool


class ToolMode(StrEnum):
    """How a chat request may call tools."""

    NONE = "none"             # no tool calls: the output is content
    AUTO = "auto"             # the model decides: its own tool-call blocks are parsed (tool_parser)
    REQUIRED = "required"     # at least one call, grammar-forced
    NAMED = "named"           # exactly one call of the named function, grammar-forced


@dataclass(frozen=True)
class ToolPolicy:
    """A request's resolved tool_choice: the mode, the forced function's name, and whether calls may be parallel."""

    mode: ToolMode
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Whether the grammar forces tool calls (required or named)."""
        return self.mode in (ToolMode.REQUIRED, ToolMode.NAMED)


def _named(tc: dict[str, Any]) -> str:
    """The function name of a `{"type": "function", "function": {"name": ...}}` tool_choice; 400 when malformed."""
    fn = tc.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tc.get("type") != "function" or not isinstance(name, str) or not name:
        raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}, got ' + shorten(tc, 80), 400, "invalid_value", "tool_choice")
    return name


def resolve(req: ChatCompletionRequest) -> ToolPolicy:
    """The request's tool policy; 400 naming tool_choice for unknown values, a forced choice without tools, or a
    function that is not among the tools."""
    tc = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if tc is None:
        return ToolPolicy(ToolMode.AUTO if req.tools else ToolMode.NONE, parallel=parallel)
    if isinstance(tc, str) and tc in ("none", "auto", "required"):
        mode, name = ToolMode(tc), None
    elif isinstance(tc, dict):
        mode, name = ToolMode.NAMED, _named(tc)
    else:
        raise APIError('tool_choice must be "none", "auto", "required" or a named function, got ' + shorten(tc, 40),
                       400, "invalid_value", "tool_choice")
    if mode in (ToolMode.REQUIRED, ToolMode.NAMED):
        if not req.tools:
            raise APIError(f"tool_choice {shorten(tc, 80)} needs tools", 400, "invalid_value", "tool_choice")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise APIError("response_format cannot be combined with a forced tool_choice (the tool's schema sets the "
                           "output's format)", 400, "invalid_value", "response_format")
    if name is not None and name not in {t.function.name for t in req.tools or ()}:
        raise APIError(f"tool_choice names the function {shorten(name, 80)}, which is not among the tools", 400,
                       "invalid_value", "tool_choice")
    if mode == ToolMode.AUTO and not req.tools:
        mode = ToolMode.NONE
    return ToolPolicy(mode, name, parallel)


def _parameters(tool: Tool) -> dict[str, Any]:
    """A tool's parameters schema (any object when it has none)."""
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def forced_output(policy: ToolPolicy, tools: list[Tool]) -> StructuredOutput | None:
    """The grammar forcing the policy's calls (None unless forced); 400 naming tools when a schema is invalid."""
    if not policy.forced:
        return None
    if policy.mode == ToolMode.NAMED:
        tool = next(t for t in tools if t.function.name == policy.name)
        schema: dict[str, Any] = _parameters(tool)
        strict = tool.function.strict is not False
    else:
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"]} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not policy.parallel:
            schema["maxItems"] = 1
        strict = all(t.function.strict is not False for t in tools)
    try:
        return StructuredOutput.json_schema(schema, strict=strict)
    except (StructuredOutputError, TypeError, ValueError) as e:
        raise APIError(f"tools: a function's parameters are not a usable JSON schema: {shorten(str(e), 300)}", 400,
                       "invalid_value", "tools") from None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """Part of one tool call: its header (id and name, the first time) and/or more of its arguments' text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_delta(self) -> dict[str, Any]:
        """OpenAI's streamed `tool_calls` entry."""
        d: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
            fn = {"name": self.name, "arguments": self.arguments}
        d["function"] = fn
        return d


@dataclass
class ScannedCall:
    """A call the scanner has reported (its arguments so far; `closed` once its JSON item ended)."""

    id: str
    name: str
    arguments: str = ""
    closed: bool = False


_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


@dataclass
class ForcedCallScanner:
    """Turns a forced output (see the module docstring) into tool calls, incrementally."""

    policy: ToolPolicy
    calls: list[ScannedCall] = field(default_factory=list)
    _depth: int = 0                 # JSON nesting depth (the array is 1, an item 2) for "required"
    _in_str: bool = False
    _esc: bool = False
    _item: str = ""                 # the current item's text before its header was recognised
    _streaming_args: bool = False   # the current item's header was reported: its text now goes to arguments

    def feed(self, text: str) -> list[CallDelta]:
        """Consume more output; return the deltas it completes."""
        if self.policy.mode == ToolMode.NAMED:
            return self._feed_named(text)
        out: list[CallDelta] = []
        args: list[str] = []
        for ch in text:
            closes_item = self._lex(ch)
            if self._depth >= 2 or closes_item:
                if closes_item:
                    self._close_item(out, args)
                elif self._streaming_args:
                    if args or self.calls[-1].arguments or not ch.isspace():   # no leading whitespace
                        args.append(ch)
                else:
                    self._item += ch
                    m = _HEAD.fullmatch(self._item)
                    if m is not None:
                        self._open_call(json.loads(m.group(1)), out)
        if args and self.calls and not self.calls[-1].closed:
            self._args(out, "".join(args))
        return out

    def _lex(self, ch: str) -> bool:
        """Track strings and depth; True when `ch` closes an item (depth 2 -> 1)."""
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
            return False
        if ch == '"':
            self._in_str = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1
            return self._depth == 1 and ch == "}"
        return False

    def _open_call(self, name: str, out: list[CallDelta]) -> None:
        call = ScannedCall(_call_id(), name)
        self.calls.append(call)
        out.append(CallDelta(len(self.calls) - 1, "", call.id, name))
        self._streaming_args = True

    def _args(self, out: list[CallDelta], text: str) -> None:
        call = self.calls[-1]
        call.arguments += text
        index = len(self.calls) - 1
        if out and out[-1].index == index:
            out[-1].arguments += text
        else:
            out.append(CallDelta(index, text))

    def _close_item(self, out: list[CallDelta], args: list[str]) -> None:
        """The item's closing brace: finish a streamed call, or parse a whole item whose header never matched."""
        if self._streaming_args:
            if args:
                self._args(out, "".join(args))
                args.clear()
            self.calls[-1].closed = True
        else:
            try:
                obj = json.loads(self._item + "}")
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                params = obj.get("parameters", obj.get("arguments", {}))
                self._open_call(obj["name"], out)
                self._args(out, json.dumps(params, ensure_ascii=False))
                self.calls[-1].closed = True
        self._item, self._streaming_args = "", False

    def _feed_named(self, text: str) -> list[CallDelta]:
        out: list[CallDelta] = []
        if not self.calls:
            self._open_call(self.policy.name or "", out)
        if text:
            self._args(out, text)
        return out

    def finish(self) -> None:
        """The output ended: a named call is complete whatever its text (the grammar ended it or max_tokens did)."""
        if self.policy.mode == ToolMode.NAMED and not self.calls:
            self._open_call(self.policy.name or "", [])
        if self.policy.mode == ToolMode.NAMED:
            self.calls[-1].closed = True


def scan_all(policy: ToolPolicy, text: str) -> list[ScannedCall]:
    """The calls in a finished forced output, as a stream would have reported them (a call cut by max_tokens keeps
    its partial arguments, as OpenAI's, with finish_reason "length")."""
    s = ForcedCallScanner(policy)
    s.feed(text)
    s.finish()
    return s.calls
