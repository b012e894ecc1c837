"""The one bound on token ids a request may name: prompts of token ids, /tokenize's output, /detokenize,
stop_token_ids and logit_bias keys are all checked against `token_id_limit`.

The bound is the model's vocabulary (the rows of its embedding and LM head) when the backend reports it, else the
tokenizer's. An id past the model's cannot be embedded, so it is refused everywhere, the same way. Ids between the
tokenizer's size and the model's (a padded embedding) decode to no text, but the model can sample them, and a client
that sends a round's output ids back as its next prompt must not be refused its own tokens; so they are accepted
(vLLM's prompt check likewise takes the larger of the two). Bounding by the smaller of the two needs the sampler to
mask those ids first.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from tandem.engine.sampling_params import MAX_LOGIT_BIAS, shorten
from tandem.server.errors import APIError

_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


def token_id_limit(client: Any) -> int | None:
    """Token ids a request may name are [0, this): the backend's `vocab_size` (the model's), else its tokenizer's;
    None when neither says."""
    for n in (getattr(client, "vocab_size", None), getattr(client.tokenizer, "vocab_size", None)):
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def check_token_ids(ids: Iterable[int], limit: int | None, param: str) -> None:
    """400 naming `param` for the first id outside [0, limit) (nothing checked when limit is None)."""
    if limit is None:
        return
    bad = next((t for t in ids if not 0 <= t < limit), None)
    if bad is not None:
        raise APIError(f"{param}: token id {shorten(bad)} is outside the vocabulary [0, {limit})", 400,
                       "invalid_value", param)


def logit_bias_cap(limit: int | None) -> int:
    """The most entries a logit_bias may have: vLLM's cap or the vocabulary's size, whichever is smaller."""
    return MAX_LOGIT_BIAS if limit is None else min(MAX_LOGIT_BIAS, limit)


def logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON string keys) as token id -> bias; a 400 naming logit_bias for more
    entries than logit_bias_cap, a key that is not an integer, an id outside [0, vocab_size), or a bias that is not a
    number in [-100, 100]."""
    if not bias:
        return None
    cap = logit_bias_cap(vocab_size)
    if len(bias) > cap:
        raise APIError(f"logit_bias may have at most {cap} entries (vLLM's cap or the vocabulary's size, whichever is "
                       f"smaller), got {len(bias)}", 400, "invalid_value", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise APIError(f"logit_bias keys must be token ids (integers), got {shorten(key)}", 400,
                           "invalid_value", "logit_bias")
        tid = int(key) if len(key) <= 20 else -1            # no vocabulary has a 20-digit id
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            top = f"[0, {vocab_size})" if vocab_size is not None else "of the model"
            shown = key if len(key) <= 20 else shorten(key)
            raise APIError(f"logit_bias: token id {shown} is outside the vocabulary {top}", 400, "invalid_value",
                           "logit_bias")
        if not math.isfinite(value) or not -100.0 <= value <= 100.0:
            raise APIError(f"logit_bias values must be in [-100, 100], got {shorten(value)} for token {tid}", 400,
                           "invalid_value", "logit_bias")
        out[tid] = value
    return out
