"""Hermes/Qwen tool-call parsing: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in generated text.

`parse_tool_calls(text)` splits a finished output into content (the text outside valid blocks, None when
empty after stripping) and tool calls. A block whose body is not a JSON object with a string `name` stays
in the content as text. A final block left open (the output was cut by max_tokens) is parsed too if its
body is complete JSON.

`StreamingToolParser` does the same incrementally: content is streamed as it arrives except for a tail that
might be the start of `<tool_call>`; text inside a block is buffered and the whole call is emitted as one
tool_calls delta (id, name and complete arguments) when `</tool_call>` arrives (or at the end).
Trailing whitespace of content is held back and dropped when only tool calls follow it.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)


@dataclass
class ParsedToolCall:
    """One function call: id `call_<hex>`, name, arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_call(body: str) -> ParsedToolCall | None:
    """The call in one block body, or None when it is not `{"name": str, "arguments": object}` JSON."""
    try:
        obj = json.loads(body.strip())
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):            # already a JSON string: keep it if it parses
        try:
            json.loads(args)
        except (json.JSONDecodeError, ValueError):
            return None
        return ParsedToolCall(obj["name"], args)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split finished text into (content or None, tool calls)."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = parse_call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept)
    if calls:
        content = content.strip()
    return (content or None), calls


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class StreamingToolParser:
    """Feed text deltas; get back (content delta, tool calls completed by this delta)."""

    def __init__(self) -> None:
        self._buf = ""               # text not yet handed out (a possible `<tool_call>` prefix, or a block)
        self._in_block = False
        self._space = ""             # trailing whitespace held back: dropped if only calls follow
        self.calls: list[ParsedToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Consume a delta; return content that is safe to stream now and any calls that closed."""
        self._buf += delta
        content: list[str] = []
        done: list[ParsedToolCall] = []
        while True:
            if not self._in_block:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_open(self._buf)
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i:]
                self._in_block = True
            j = self._buf.find(CLOSE)
            if j < 0:
                break
            block, self._buf = self._buf[:j + len(CLOSE)], self._buf[j + len(CLOSE):]
            self._in_block = False
            call = parse_call(block[len(OPEN):-len(CLOSE)])
            if call is None:
                content.append(block)
            else:
                done.append(call)
        self.calls.extend(done)
        return self._hold_space("".join(content)), done

    def _hold_space(self, text: str) -> str:
        """Hold trailing whitespace back until more content follows (it may only precede a call)."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return body

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """Flush at the end of the output: an open block is parsed if complete JSON, else streamed as text."""
        buf, self._buf = self._buf, ""
        if self._in_block:
            self._in_block = False
            call = parse_call(buf[len(OPEN):])
            if call is not None:
                self.calls.append(call)
                return "", [call]
        space, self._space = self._space, ""
        text = space + buf
        return ("" if self.calls and not text.strip() else text), []
