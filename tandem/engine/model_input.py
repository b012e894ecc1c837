"""One step's flattened batch as the executor takes it (ModelInput), and the prompt logprobs a step asks for."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import RequestGrammar


@dataclass
class PromptLogprobsSpec:
    """Prompt logprobs wanted from one sequence of a step: its query rows predict `targets` (the prompt tokens
    after each of its first len(targets) query positions); top `k` entries per position besides the target."""

    seq: int                  # the sequence's index in the batch (order of ModelInput.add)
    targets: list[int]
    k: int


@dataclass
class ModelInput:
    """One step's flattened batch: per sequence its new tokens, where they sit, and its KV blocks."""

    token_ids: list[int] = field(default_factory=list)     # all sequences' query tokens, concatenated
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)      # KV length of each sequence after the step
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)   # sequences whose last query token is sampled
    params: list[SamplingParams] = field(default_factory=list)       # per sampled row
    generators: list[torch.Generator | None] = field(default_factory=list)
    output_tokens: list[list[int]] = field(default_factory=list)     # per sampled row, for penalties
    prompt_tokens: list[list[int]] = field(default_factory=list)     # per sampled row (repetition penalty)
    grammars: list[RequestGrammar | None] = field(default_factory=list)  # per sampled row (structured output)
    prompt_logprobs: list[PromptLogprobsSpec] = field(default_factory=list)  # sequences computing prompt logprobs
    pad_to: int = 0           # run the token-wise layers over this many rows (a LAPS bucket: length x batch), the
                              # real tokens first, padding rows after them; attention and sampling see only the real
    bucket: tuple[int, int] | None = None   # the LAPS bucket (length, batch) of a padded step (pad_to = length x
                              # batch): on CUDA its prefill graph replays it (engine/prefill_graphs.py)

    def add(self, token_ids: list[int], start: int, block_table: list[int]) -> None:
        """Append a sequence whose tokens `token_ids` occupy positions start, start+1, ..."""
        n = len(token_ids)
        self.token_ids.extend(token_ids)
        self.positions.extend(range(start, start + n))
        self.query_lens.append(n)
        self.seq_lens.append(start + n)
        self.block_tables.append(block_table)
