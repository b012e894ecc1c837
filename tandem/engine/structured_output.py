"""Structured output (a JSON object, or JSON that follows a JSON schema) with xgrammar, as vLLM and SGLang do it.

* `StructuredOutput` is what a request asks for (SamplingParams.structured_output). It is checked when made: a
  malformed schema raises StructuredOutputError (a ValueError) with a one-line message, so a bad request fails at
  the door, not in the middle of a batch.
* `StructuredOutputManager` is one per engine: xgrammar's TokenizerInfo and GrammarCompiler, built on first use from
  the engine tokenizer's vocabulary (each id's bytes; special tokens never match text; EOS ids are the grammar's
  stop tokens; the bitmask is as wide as the model's logits), and an LRU cache of compiled grammars keyed by spec.
* `RequestGrammar` is one per request: an xgrammar GrammarMatcher, advanced with every sampled token (the first
  one, sampled at the end of prefill, included). When it terminates (the grammar is complete and EOS was taken)
  the request ends with finish_reason "stop".
* `apply_grammar_bitmask` masks a batch of logits: one int32 bitmask [N, ceil(V/32)] for the batch, filled for the
  rows that have a grammar, then applied in place to those rows only (others are left as they are). EOS is among
  the allowed tokens only where the grammar may end.

Whitespace: by default (`any_whitespace=False`) the JSON is on one line with xgrammar's separators (", ", ": "),
so a model cannot loop on whitespace between tokens (vLLM's `disable_any_whitespace`, a known failure of small
models); `any_whitespace=True` allows any whitespace JSON allows.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

JSON_OBJECT, JSON_SCHEMA = "json_object", "json_schema"
KINDS = (JSON_OBJECT, JSON_SCHEMA)          # room for "regex" and "grammar" (xgrammar compiles both)
MAX_SHOWN = 100                             # an error message quotes at most this many characters
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")     # "[21:42:08] /project/cpp/x.cc:4944: " in xgrammar errors


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be served (malformed schema, unknown kind); one-line message."""


def _one_line(e: BaseException) -> str:
    text = _XGR_PREFIX.sub("", str(e).strip())
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:300] + "..."


def shorten(value: Any, limit: int = MAX_SHOWN) -> str:
    """repr(value) cut to `limit` characters (an error must not echo a 10 MB value back)."""
    try:
        text = repr(value)
    except ValueError:                  # an int with more digits than Python will print
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be: any JSON object (`json_object`) or JSON valid for `schema` (`json_schema`).

    `schema` may be given as a dict (or bool) or as JSON text; it is kept as compact JSON text (key order kept:
    properties are generated in the schema's order), so the spec is hashable and is the compiled-grammar cache key.
    `strict` (JSON schema): no properties or items beyond the schema's unless it allows them (xgrammar's strict_mode;
    OpenAI's strict). `any_whitespace`: see the module docstring.
    """

    kind: str = JSON_OBJECT
    schema: Any = None
    strict: bool = True
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {', '.join(KINDS)}, "
                                        f"got {shorten(self.kind)}")
        for name in ("strict", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise StructuredOutputError(f"structured output {name} must be a bool, "
                                            f"got {shorten(getattr(self, name))}")
        if self.kind == JSON_OBJECT:
            if self.schema is not None:
                raise StructuredOutputError("structured output json_object takes no schema (use json_schema)")
            return
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(f"JSON schema must be an object (or a bool), got {shorten(schema)}")
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise StructuredOutputError(f"JSON schema is not JSON-serialisable: {_one_line(e)}") from None
        import xgrammar as xgr

        try:      # tokenizer-independent: the schema -> EBNF conversion the compiler will do
            xgr.Grammar.from_json_schema(text, any_whitespace=self.any_whitespace, strict_mode=self.strict)
        except Exception as e:      # xgrammar raises RuntimeError (C++ errors) or ValueError
            raise StructuredOutputError(f"invalid JSON schema: {_one_line(e)}") from None
        object.__setattr__(self, "schema", text)

    @classmethod
    def json_object(cls, any_whitespace: bool = False) -> StructuredOutput:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls(JSON_OBJECT, None, any_whitespace=any_whitespace)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str, strict: bool = True,
                    any_whitespace: bool = False) -> StructuredOutput:
        """JSON valid for `schema` (OpenAI's response_format {"type": "json_schema", ...})."""
        return cls(JSON_SCHEMA, schema, strict=strict, any_whitespace=any_whitespace)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutput:
        """From its fields as a dict (how a StructuredOutput travels in a message)."""
        if not isinstance(d, dict):
            raise StructuredOutputError(f"structured output must be a dict of its fields, got {shorten(d)}")
        unknown = set(d) - {"kind", "schema", "strict", "any_whitespace"}
        if unknown:
            raise StructuredOutputError(f"unknown structured output fields: {', '.join(sorted(map(str, unknown)))}")
        return cls(**d)

    @classmethod
    def from_response_format(cls, rf: dict[str, Any] | None) -> StructuredOutput | None:
        """OpenAI's `response_format`: text (None), json_object, or json_schema {name, schema, strict}."""
        if rf is None:
            return None
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == JSON_OBJECT:
            return cls.json_object()
        if kind == JSON_SCHEMA:
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise StructuredOutputError("response_format json_schema needs json_schema.schema")
            strict = js.get("strict")
            return cls.json_schema(js["schema"], strict=True if strict is None else strict)
        raise StructuredOutputError(f"response_format type must be text, json_object or json_schema, "
                                    f"got {shorten(kind)}")


# ---------------------------------------------------------------------------------------------- vocabulary
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def vocab_bytes(tokenizer: Any, vocab_size: int) -> tuple[list[bytes], bool]:
    """Each token id's bytes as it appears in decoded text (b"" for special tokens and ids past the tokenizer's
    vocabulary), and whether the tokenizer prepends a space (SentencePiece); from the Tokenizer's public API.

    The vocabulary's spelling is detected as xgrammar does: byte-level BPE (GPT-2's alphabet, e.g. "Ġ" for a
    space), byte fallback ("<0x0A>" pieces, "▁" for a space), or raw text. Added tokens keep their text.
    """
    n = min(tokenizer.vocab_size, vocab_size)
    pieces = [tokenizer.id_to_token(i) for i in range(n)]
    present = {p for p in pieces if p is not None}
    alphabet = _byte_level_alphabet()
    if sum(f"<0x{b:02X}>" in present for b in range(256)) >= 128:
        spelling = "byte_fallback"
    elif sum(c in present for c in alphabet) >= 128:
        spelling = "byte_level"
    else:
        spelling = "raw"
    out: list[bytes] = []
    for i, p in enumerate(pieces):
        if p is None or (tokenizer.decode([i], skip_special_tokens=True) == ""
                         and tokenizer.decode([i], skip_special_tokens=False) != ""):
            out.append(b"")                     # special: never part of the text a grammar matches
        elif spelling == "byte_level" and all(c in alphabet for c in p):
            out.append(bytes(alphabet[c] for c in p))
        elif spelling == "byte_fallback" and (m := _BYTE_FALLBACK.fullmatch(p)):
            out.append(bytes([int(m.group(1), 16)]))
        elif spelling == "byte_fallback":
            out.append(p.replace("▁", " ").encode("utf-8"))
        else:
            out.append(p.encode("utf-8"))
    out += [b""] * (vocab_size - n)            # the model's padded ids
    prefix_space = False
    if spelling == "byte_fallback":
        first = tokenizer.encode("a", add_special_tokens=False)[:1]
        prefix_space = bool(first) and (tokenizer.id_to_token(first[0]) or "").startswith("▁")
    return out, prefix_space


# ---------------------------------------------------------------------------------------------- per request
class RequestGrammar:
    """One request's grammar state (an xgrammar GrammarMatcher)."""

    __slots__ = ("spec", "matcher", "rejected")

    def __init__(self, spec: StructuredOutput, matcher: Any) -> None:
        self.spec = spec
        self.matcher = matcher
        self.rejected: int | None = None          # a token the grammar refused (a bug if masks were applied)

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and its stop token (EOS) was accepted, or a token was refused."""
        return self.rejected is not None or self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance with the sampled token; True when the request must end now (terminated, or token refused)."""
        if self.terminated:
            return True
        if not self.matcher.accept_token(int(token_id)):
            self.rejected = int(token_id)
            return True
        return self.matcher.is_terminated()

    def fill(self, bitmask: Any, row: int) -> bool:
        """Write the allowed next tokens into bitmask[row]; False when every token is allowed (no need to apply)."""
        return self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammar_bitmask(logits: Any, grammars: Sequence[RequestGrammar | None]) -> list[int]:
    """Set to -inf, in place, the logits of tokens row i's grammar does not allow next (rows with None or a
    terminated grammar untouched); one bitmask for the batch. Returns the rows that were masked."""
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    if not rows:
        return []
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    need = [i for i in rows if grammars[i].fill(bitmask, i)]
    if need:
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=need)
    return need


# ---------------------------------------------------------------------------------------------- per engine
class StructuredOutputManager:
    """The engine's grammar compiler (built once, on first use, from its tokenizer) and compiled-grammar cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 256, max_threads: int = 8) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)          # the model's logits width (may exceed the tokenizer's vocab)
        self.cache_size = cache_size
        self.max_threads = max_threads
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()

    @property
    def compiler(self) -> Any:
        """xgrammar's GrammarCompiler for this tokenizer (its own cache off: ours is bounded)."""
        if self._compiler is None:
            import xgrammar as xgr

            encoded, prefix_space = vocab_bytes(self.tokenizer, self.vocab_size)
            eos = [t for t in getattr(self.tokenizer, "eos_token_ids", []) if 0 <= t < self.vocab_size]
            info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                     stop_token_ids=eos or None, add_prefix_space=prefix_space)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of a spec, from the cache when an equal spec was compiled before."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        try:
            if spec.kind == JSON_OBJECT:     # an object (not xgrammar's builtin JSON: that allows arrays too)
                compiled = self.compiler.compile_json_schema('{"type":"object"}', any_whitespace=spec.any_whitespace,
                                                             strict_mode=False)
            else:
                compiled = self.compiler.compile_json_schema(spec.schema, any_whitespace=spec.any_whitespace,
                                                             strict_mode=spec.strict)
        except Exception as e:
            raise StructuredOutputError(f"cannot compile the {spec.kind} grammar: {_one_line(e)}") from None
        self._cache[spec] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def grammar(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for one request."""
        import xgrammar as xgr

        return RequestGrammar(spec, xgr.GrammarMatcher(self.compile(spec)))
