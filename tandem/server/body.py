"""JSON request bodies: a structure check that runs while the body is scanned, then one parse-and-validate.

A body under the byte cap can still hold work out of proportion to its size: 700k keys in `logit_bias` took 5 s to
parse and 1 s to validate. `check_structure` makes one linear pass over the bytes first, a regex stepping from one
string or structural character to the next (strings, numbers and whitespace are skipped inside the regex engine),
and stops at the first of:

* an object with more than `max_object_keys` keys,
* more than `max_total_keys` keys in the whole body,
* an array with more than `max_array` items, or more than `max_total_items` array items in the whole body,
* nesting deeper than `max_depth`,

with a 400 that names the top-level field holding the offence. A body that passes has bounded work, and is parsed
and validated in one call of pydantic's Rust JSON reader (`model_validate_json`), which benchmarks/body_parse.py
measured as the fastest safe choice: each C call the check makes covers one string or one run of skipped bytes, and
the Python between them gives the GIL back to the event loop every switch interval.

Unknown top-level fields are ignored with a warning naming them (vLLM's rule); they cost no more than known ones,
because the check above bounds them the same way.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from tandem.engine.sampling_params import shorten
from tandem.server.errors import APIError, validation_error

log = logging.getLogger("tandem.server")

DEFAULT_MAX_DEPTH = 64               # nesting of objects and arrays (a tool's JSON schema nests a few levels)
DEFAULT_MAX_OBJECT_KEYS = 4096       # keys in one object (logit_bias is capped lower by its own rule)
DEFAULT_MAX_TOTAL_KEYS = 1 << 16     # keys in the whole body
MIN_TOTAL_ITEMS = 1 << 16            # array items in the whole body: at least this many, or twice the longest array
MAX_WARNED_FIELDS = 5                # an unknown-fields warning names at most this many
ARRAY_SLACK = 2                      # the check refuses arrays over this many times the longest a field takes: a
                                     # smaller overage reaches the field's own check, whose 400 says more (e.g.
                                     # context_length_exceeded for a prompt of token ids)
_ITEMS_PER_TOTAL = 2

# One token of the check: a string (escapes handled inside the regex; at most _ESCAPES_PER_MATCH escapes and runs of
# _RUN_PER_MATCH plain bytes per match, so no single call runs long, and possessive, so a failed match never
# backtracks), '[' or ',' with the run of numbers after it (their commas counted in C), or another structural
# character. Groups: 1 the string's closing quote, 2 the ':' after a key, 3 '[', 4 ',', 5 '{', 6 '}', 7 ']'.
_ESCAPES_PER_MATCH = 4096
_RUN_PER_MATCH = 1 << 16
_STRING = (rb'[^"\\]{0,%d}+(?:\\.[^"\\]{0,%d}+){0,%d}+(?:(")[ \t\r\n]*+(:)?)?'
           % (_RUN_PER_MATCH, _RUN_PER_MATCH, _ESCAPES_PER_MATCH))
_NUMBER_RUN = rb"[-+0-9.eE \t\r\n,]*+"
_TOKEN = re.compile(rb'"' + _STRING + rb"|(\[)" + _NUMBER_RUN + rb"|(,)" + _NUMBER_RUN + rb"|(\{)|(\})|(\])")
_STRING_REST = re.compile(_STRING)            # the rest of a string with more escapes than one match takes
_OBJECT, _ARRAY = 5, 3


@dataclass(frozen=True)
class BodyLimits:
    """Structure caps on a JSON body (see the module doc); `for_longest` derives them from the model's context."""

    max_array: int
    max_depth: int = DEFAULT_MAX_DEPTH
    max_object_keys: int = DEFAULT_MAX_OBJECT_KEYS
    max_total_keys: int = DEFAULT_MAX_TOTAL_KEYS
    max_total_items: int | None = None          # None: max(MIN_TOTAL_ITEMS, 2 x max_array)

    @classmethod
    def for_longest(cls, longest: int) -> BodyLimits:
        """The caps for requests whose longest array field takes `longest` elements (messages or token ids)."""
        return cls(max_array=ARRAY_SLACK * longest)

    @property
    def total_items(self) -> int:
        """The cap on array items in the whole body."""
        if self.max_total_items is not None:
            return self.max_total_items
        return max(MIN_TOTAL_ITEMS, _ITEMS_PER_TOTAL * self.max_array)


def _refuse(what: str, field: str | None) -> APIError:
    where = f"{field}: " if field else "request body: "
    return APIError(f"{where}{what}", 400, "invalid_value", field)


def check_structure(raw: bytes, limits: BodyLimits) -> list[str]:
    """400 at the first structure cap the body exceeds (see the module doc); the top-level keys otherwise.

    Malformed JSON is left to the parser, except an unterminated string (a 400 invalid_json here)."""
    max_array, max_keys, max_depth = limits.max_array, limits.max_object_keys, limits.max_depth
    keys_cap, items_cap = limits.max_total_keys, limits.total_items
    kinds: list[int] = []        # the open containers: _OBJECT or _ARRAY
    counts: list[int] = []       # their keys (an object) or commas (an array) so far
    top: list[str] = []          # the top-level keys, in order
    field: str | None = None     # the top-level key whose value is being read
    total_keys = total_items = 0
    search, rest, count = _TOKEN.search, _STRING_REST.match, raw.count
    pos = 0
    while True:
        m = search(raw, pos)
        if m is None:
            return top
        pos = m.end()
        k = m.lastindex
        if k is None or k <= 2:                                   # a string
            start = m.start()
            while k is None:                                      # more escapes than one match takes, or no end
                m = rest(raw, pos)
                if m.end() == pos:
                    raise APIError("malformed JSON body: a string does not end", 400, "invalid_json")
                pos, k = m.end(), m.lastindex
            if k == 2 and kinds and kinds[-1] == _OBJECT:        # a key
                counts[-1] += 1
                total_keys += 1
                if len(kinds) == 1:
                    field = _shown(raw[start + 1:m.start(1)])
                    top.append(field)
                if counts[-1] > max_keys:
                    raise _refuse(f"an object has more than {max_keys} keys", field)
                if total_keys > keys_cap:
                    raise _refuse(f"the body has more than {keys_cap} keys in all", field)
        elif k <= 4:                                              # '[' or ',', then a run of numbers
            if k == _ARRAY:
                kinds.append(_ARRAY)
                counts.append(0)
                if len(kinds) > max_depth:
                    raise _refuse(f"objects and arrays nest deeper than {max_depth} levels", field)
            if kinds and kinds[-1] == _ARRAY:
                s = m.start()
                commas = count(b",", s, pos) if pos - s > 1 else int(k == 4)
                counts[-1] += commas
                total_items += commas
                if counts[-1] >= max_array:
                    raise _refuse(f"an array has more than {max_array} elements (no field takes that many)", field)
                if total_items > items_cap:
                    raise _refuse(f"the body has more than {items_cap} array elements in all", field)
        elif k == _OBJECT:
            kinds.append(_OBJECT)
            counts.append(0)
            if len(kinds) > max_depth:
                raise _refuse(f"objects and arrays nest deeper than {max_depth} levels", field)
        else:                                                     # '}' or ']'
            if not kinds:
                return top                                        # unbalanced: the parser says where
            kinds.pop()
            counts.pop()
            if not kinds:
                field = None


def _shown(key: bytes) -> str:
    """A top-level key as the client wrote it (escapes as they are), cut to 100 characters."""
    text = key[:400].decode("utf-8", "replace")
    return text if len(text) <= 100 else text[:100] + "..."


def decode(raw: bytes, model: type[BaseModel], limits: BodyLimits) -> BaseModel:
    """The validated request: structure checked, then parsed and validated in one call; 400s name the field
    (invalid_json when malformed). Unknown top-level fields are ignored with a warning."""
    keys = check_structure(raw, limits)
    try:
        req = model.model_validate_json(raw or b"")
    except ValidationError as e:
        bad = next((err for err in e.errors() if err.get("type") == "json_invalid"), None)
        if bad is not None:
            raise APIError(f"malformed JSON body: {bad.get('msg')}", 400, "invalid_json") from None
        raise validation_error(e) from None
    unknown = [k for k in keys if k not in model.model_fields]
    if unknown:
        shown = ", ".join(shorten(k, 40) for k in unknown[:MAX_WARNED_FIELDS])
        more = f" and {len(unknown) - MAX_WARNED_FIELDS} more" if len(unknown) > MAX_WARNED_FIELDS else ""
        log.warning("The following fields were present in the request but ignored: %s%s", shown, more)
    return req
