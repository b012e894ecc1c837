"""The one bound on token ids a request may name: prompts of token ids, /tokenize's output, /detokenize,
stop_token_ids and logit_bias keys are all checked against `token_id_limit`.

The bound is the smaller of the model's vocabulary (rows of its embedding and LM head) and the tokenizer's: an id at
or past the model's cannot be embedded (the engine would fail on it), and an id at or past the tokenizer's decodes to
nothing, so its text, its logprobs' token strings and any stop check on it would be wrong. vLLM takes the larger of
the two for prompts (some models pad their embedding past the tokenizer, some tokenizers hold multimodal placeholders
past the model); tandem serves text only, where neither padding row nor placeholder is a token a client can mean.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tandem.engine.sampling_params import MAX_LOGIT_BIAS, shorten
from tandem.server.errors import APIError


def token_id_limit(client: Any) -> int | None:
    """Token ids a request may name are [0, this): the smaller of the backend's `vocab_size` (the model's) and its
    tokenizer's; None when neither says."""
    sizes = [n for n in (getattr(client, "vocab_size", None), getattr(client.tokenizer, "vocab_size", None))
             if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(sizes) if sizes else None


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
