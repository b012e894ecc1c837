"""Batched next-token sampling, each row with its own SamplingParams, in vLLM's order.

Per batch of logits [N, V] (float32 or castable):

1. raw logprobs = log_softmax(logits), only if some row asked for logprobs (vLLM's default
   "raw_logprobs": what the model thinks, before any processing);
2. every row, greedy ones included (as vLLM): EOS and stop_token_ids masked to -inf while the row
   has fewer than min_tokens output tokens, then each row's logit_bias added (vLLM v1's logits
   processors that can change the argmax, min tokens then logit bias, run before the penalties; one
   scatter-add for the batch); repetition (prompt + output tokens), then frequency and presence
   (output tokens) penalties; then, for rows with a grammar (structured output), the tokens
   the grammar does not allow next masked to -inf (one bitmask for the batch; a row that min_tokens
   and its grammar together leave with no token keeps its grammar's mask only);
3. greedy rows (temperature 0 or top_k 1): argmax, ties to the lowest id;
4. random rows: temperature, top-k, top-p, min-p (vLLM v0's order), softmax, then one draw by an
   exponential race, argmax(probs / q) with q ~ Exp(1) drawn from the row's own torch.Generator
   when it has one (so a seeded request gets the same tokens whatever else is in the batch) or
   from the sampler's default generator otherwise.

Everything but the per-seeded-row noise draw is vectorised over the rows that need it.

Logit decomposition (`sample_hidden` with max_rows, logits.py): the batch's hidden rows are projected and sampled
in chunks of at most max_rows rows, each chunk with its slice of the per-row state (params, generators, token
histories, grammars); whether logprobs and how many top logprobs are returned is decided once for the batch. Every
step above is row-wise, so the tokens and logprobs equal the monolithic call's. The one shared state is the default
generator of unseeded random rows: each chunk draws its rows' noise from it in row order, and on the CPU a draw of
[a, V] then [b, V] gives the same numbers as one draw of [a + b, V] (tests/test_engine_logits.py), so unseeded rows
are identical too there; on CUDA (Philox offsets per call) only seeded rows are guaranteed identical.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.engine.logits import LogitsFn, check_max_rows, reduce_logits
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import RequestGrammar, apply_grammar_bitmask


@dataclass(slots=True)
class SampleOutput:
    """One sampled token per row, plus its raw logprob and top logprobs where asked."""

    token_ids: list[int]
    logprobs: list[float] | None = None               # every row, when any row set logprobs
    top_logprobs: list[dict[int, float]] | None = None  # every row ({} where not asked), when any asked k > 0
    # the model runner's prompt logprobs: per ModelInput.prompt_logprobs spec, one {token: logprob} per target
    prompt_logprobs: list[list[dict[int, float]]] | None = None


def _rows(seq: Sequence | None, rows: slice) -> Sequence | None:
    """A chunk's slice of a per-row sequence (None stays None)."""
    return None if seq is None else seq[rows]


def make_generator(seed: int | None, device: torch.device | str | None = None) -> torch.Generator | None:
    """A generator seeded with `seed` on `device` for a seeded request, None for an unseeded one."""
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device) if device is not None else "cpu")
    g.manual_seed(int(seed))
    return g


class Sampler:
    """Samples one token per row of a logits batch; stateless apart from the default generators."""

    def __init__(self, eos_token_ids: Iterable[int] = (), seed: int | None = None) -> None:
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.seed = seed
        self._default: dict[torch.device, torch.Generator] = {}

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The generator used by rows without their own (seeded from `seed`, else from entropy)."""
        g = self._default.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed)
            self._default[device] = g
        return g

    @torch.inference_mode()
    def sample(self, logits: Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None,
               output_tokens: Sequence[Sequence[int]] | None = None,
               prompt_tokens: Sequence[Sequence[int]] | None = None,
               grammars: Sequence[RequestGrammar | None] | None = None) -> SampleOutput:
        """Sample row i of `logits` under params[i]; output_tokens enable min_tokens and penalties; grammars[i]
        (structured output), where not None, limits row i to the tokens its grammar allows next."""
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits must be [N, V] with N = len(params) = {len(params)}, "
                             f"got shape {tuple(logits.shape)}")
        self._check_rows(len(params), generators, grammars)
        if not params:
            return SampleOutput([])
        want_lp, kmax = self._logprob_plan(params)
        return self._sample_rows(logits, params, generators, output_tokens, prompt_tokens, grammars, want_lp, kmax)

    @torch.inference_mode()
    def sample_hidden(self, hidden: Tensor, compute_logits: LogitsFn, params: Sequence[SamplingParams],
                      generators: Sequence[torch.Generator | None] | None = None,
                      output_tokens: Sequence[Sequence[int]] | None = None,
                      prompt_tokens: Sequence[Sequence[int]] | None = None,
                      grammars: Sequence[RequestGrammar | None] | None = None,
                      max_rows: int | None = None) -> SampleOutput:
        """sample(compute_logits(hidden), ...) with the LM head and the sampling run on chunks of at most max_rows
        rows (logit decomposition): each chunk carries its slice of the per-row state and its [rows, V] tensors are
        freed before the next chunk is projected. Same tokens and logprobs as the monolithic call (None)."""
        check_max_rows(max_rows)
        if hidden.dim() != 2 or hidden.shape[0] != len(params):
            raise ValueError(f"hidden must be [N, H] with N = len(params) = {len(params)}, "
                             f"got shape {tuple(hidden.shape)}")
        self._check_rows(len(params), generators, grammars)
        if not params:
            return SampleOutput([])
        want_lp, kmax = self._logprob_plan(params)      # batch-wide, so every chunk returns the same fields

        def part(rows: slice, logits: Tensor) -> SampleOutput:
            return self._sample_rows(logits, params[rows], _rows(generators, rows), _rows(output_tokens, rows),
                                     _rows(prompt_tokens, rows), _rows(grammars, rows), want_lp, kmax)

        parts = reduce_logits(compute_logits, hidden, max_rows, part)
        if len(parts) == 1:
            return parts[0]
        out = SampleOutput([t for p in parts for t in p.token_ids])
        if want_lp:
            out.logprobs = [lp for p in parts for lp in p.logprobs]
        if kmax > 0:
            out.top_logprobs = [d for p in parts for d in p.top_logprobs]
        return out

    @staticmethod
    def _check_rows(n: int, generators: Sequence[torch.Generator | None] | None,
                    grammars: Sequence[RequestGrammar | None] | None) -> None:
        """ValueError unless generators and grammars, when given, have one entry per row."""
        if generators is not None and len(generators) != n:
            raise ValueError(f"need one generator (or None) per row: {len(generators)} for {n} rows")
        if grammars is not None and len(grammars) != n:
            raise ValueError(f"need one grammar (or None) per row: {len(grammars)} for {n} rows")

    @staticmethod
    def _logprob_plan(params: Sequence[SamplingParams]) -> tuple[bool, int]:
        """(whether any row wants logprobs, the largest top-k asked): decided once per batch."""
        return any(p.logprobs is not None for p in params), max(p.logprobs or 0 for p in params)

    def _sample_rows(self, logits: Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None] | None,
                     output_tokens: Sequence[Sequence[int]] | None,
                     prompt_tokens: Sequence[Sequence[int]] | None,
                     grammars: Sequence[RequestGrammar | None] | None,
                     want_lp: bool, kmax: int) -> SampleOutput:
        """Sample every row of logits [n, V] (a whole batch or one chunk of it); every operation is row-wise."""
        n = len(params)
        device = logits.device
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None

        x = logits
        constrained = grammars is not None and any(g is not None for g in grammars)
        modifies = self._modifies(params, output_tokens, prompt_tokens)
        if modifies or constrained:                                   # else no copy of the [N, V] logits
            x = logits.clone()
            if output_tokens is not None:
                self._mask_min_tokens(x, params, output_tokens)
            self._apply_logit_bias(x, params)
            self._apply_penalties(x, params, output_tokens, prompt_tokens)
            if constrained:
                masked = apply_grammar_bitmask(x, grammars)
                if masked and modifies:
                    self._revive(x, logits, masked, grammars)

        tokens = torch.empty(n, dtype=torch.long, device=device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if len(greedy) == n:
            tokens = x.argmax(dim=-1)
        elif greedy:
            gi = torch.tensor(greedy, device=device)
            tokens[gi] = x[gi].argmax(dim=-1)
        if rand:
            tokens_r = self._sample_random(x if len(rand) == n else x[torch.tensor(rand, device=device)],
                                           [params[i] for i in rand],
                                           [generators[i] if generators is not None else None for i in rand])
            if len(rand) == n:
                tokens = tokens_r
            else:
                tokens[torch.tensor(rand, device=device)] = tokens_r

        out = SampleOutput(tokens.tolist())
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
            if kmax > 0:
                vals, idx = raw_logprobs.topk(min(kmax, raw_logprobs.shape[1]), dim=-1)
                vals, idx = vals.tolist(), idx.tolist()
                out.top_logprobs = [dict(zip(idx[i][:p.logprobs or 0], vals[i][:p.logprobs or 0]))
                                    for i, p in enumerate(params)]
        return out

    @staticmethod
    def _modifies(params: Sequence[SamplingParams], output_tokens: Sequence[Sequence[int]] | None,
                  prompt_tokens: Sequence[Sequence[int]] | None) -> bool:
        """Whether min_tokens masking, a logit_bias or a penalty changes some row's logits in this batch."""
        if any(p.logit_bias for p in params):
            return True
        if output_tokens is not None and any(p.min_tokens and len(output_tokens[i]) < p.min_tokens
                                             for i, p in enumerate(params)):
            return True
        if output_tokens is None and prompt_tokens is None:
            return False
        return any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                   for p in params)

    @staticmethod
    def _revive(x: Tensor, logits: Tensor, rows: list[int], grammars: Sequence[RequestGrammar | None]) -> None:
        """A masked row left with no finite logit (min_tokens forbids EOS where the grammar allows only EOS)
        falls back to its raw logits under its grammar's mask: the grammar wins."""
        ri = torch.tensor(rows, device=x.device)
        dead = ~torch.isfinite(x[ri]).any(dim=-1)
        if not bool(dead.any()):
            return
        dead_rows = ri[dead]
        sub = logits[dead_rows].clone()
        apply_grammar_bitmask(sub, [grammars[i] for i in dead_rows.tolist()])
        x[dead_rows] = sub

    def _mask_min_tokens(self, x: Tensor, params: Sequence[SamplingParams],
                         output_tokens: Sequence[Sequence[int]]) -> None:
        """Forbid EOS (unless ignore_eos) and stop_token_ids while a row is short of min_tokens."""
        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(params):
            if p.min_tokens and len(output_tokens[i]) < p.min_tokens:
                ids = set(p.stop_token_ids)
                if not p.ignore_eos:
                    ids.update(self.eos_token_ids)
                ids = [t for t in ids if t < x.shape[1]]
                rows += [i] * len(ids)
                cols += ids
        if rows:
            x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = float("-inf")

    @staticmethod
    def _apply_logit_bias(x: Tensor, params: Sequence[SamplingParams]) -> None:
        """Add every row's logit_bias to its logits, in place, with one scatter-add over the batch."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                rows += [i] * len(p.logit_bias)
                cols += p.logit_bias.keys()
                vals += p.logit_bias.values()
        if not rows:
            return
        v = x.shape[1]
        bad = next((t for t in cols if t >= v), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {v})")
        dev = x.device
        x.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                     torch.tensor(vals, dtype=x.dtype, device=dev), accumulate=True)

    @staticmethod
    def _apply_penalties(x: Tensor, params: Sequence[SamplingParams],
                         output_tokens: Sequence[Sequence[int]] | None,
                         prompt_tokens: Sequence[Sequence[int]] | None) -> None:
        """vLLM's repetition (seen in prompt or output), frequency and presence penalties, in place."""
        if output_tokens is None and prompt_tokens is None:
            return
        rows = [i for i, p in enumerate(params)
                if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if not rows:
            return
        device, v = x.device, x.shape[1]

        def dense(seqs: Sequence[Sequence[int]] | None) -> Tensor:
            counts = torch.zeros(len(rows), v, device=device)
            if seqs is None:
                return counts
            r = [j for j, i in enumerate(rows) for _ in seqs[i]]
            c = [t for i in rows for t in seqs[i]]
            if r:
                counts.index_put_((torch.tensor(r, device=device), torch.tensor(c, device=device)),
                                  torch.ones(len(r), device=device), accumulate=True)
            return counts

        ri = torch.tensor(rows, device=device)
        sub = x[ri]
        out_counts = dense(output_tokens)
        rep = torch.tensor([params[i].repetition_penalty for i in rows], device=device)[:, None]
        seen = out_counts > 0
        if prompt_tokens is not None:
            seen |= dense(prompt_tokens) > 0
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen & (rep != 1.0), penalised, sub)
        freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in rows], device=device)[:, None]
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()
        x[ri] = sub

    def _sample_random(self, x: Tensor, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None]) -> Tensor:
        """Temperature, top-k, top-p, min-p, then an exponential-race draw per row; returns [R] ids."""
        device = x.device
        r, v = x.shape
        temp = torch.tensor([p.temperature for p in params], device=device)[:, None]
        x = x / temp

        # top-k and top-p on one stable descending sort (ties keep the lowest ids first).
        k = [p.top_k if p.top_k > 0 else v for p in params]
        cut = [i for i, p in enumerate(params) if k[i] < v or p.top_p < 1.0]
        if cut:
            ci = torch.tensor(cut, device=device) if len(cut) < r else None
            sub = x if ci is None else x[ci]
            s_logits, s_idx = torch.sort(sub, dim=-1, descending=True, stable=True)
            kt = torch.tensor([k[i] for i in cut], device=device)[:, None]
            s_logits.masked_fill_(torch.arange(v, device=device)[None, :] >= kt, float("-inf"))
            if any(params[i].top_p < 1.0 for i in cut):
                pt = torch.tensor([params[i].top_p for i in cut], device=device)[:, None]
                s_probs = torch.softmax(s_logits, dim=-1)
                before = torch.cumsum(s_probs, dim=-1) - s_probs   # mass of the better tokens
                drop = (before >= pt) & (pt < 1.0)
                drop[:, 0] = False
                s_logits.masked_fill_(drop, float("-inf"))
            sub = torch.empty_like(sub).scatter_(1, s_idx, s_logits)
            if ci is None:
                x = sub
            else:
                x[ci] = sub

        probs = torch.softmax(x, dim=-1)
        mp = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if mp:
            mpt = torch.zeros(r, 1, device=device)
            mpt[mp, 0] = torch.tensor([params[i].min_p for i in mp], device=device)
            low = probs < mpt * probs.max(dim=-1, keepdim=True).values
            probs = torch.softmax(x.masked_fill(low, float("-inf")), dim=-1)

        q = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            draw = torch.empty(len(shared), v, device=device).exponential_(
                generator=self.default_generator(device))
            if len(shared) == r:
                q = draw
            else:
                q[torch.tensor(shared, device=device)] = draw
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        q.clamp_min_(torch.finfo(q.dtype).tiny)    # Exp(1) can be exactly 0: avoid 0/0 on masked tokens
        return (probs / q).argmax(dim=-1)
