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
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

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
        n = len(params)
        if generators is not None and len(generators) != n:
            raise ValueError(f"need one generator (or None) per row: {len(generators)} for {n} rows")
        if grammars is not None and len(grammars) != n:
            raise ValueError(f"need one grammar (or None) per row: {len(grammars)} for {n} rows")
        if n == 0:
            return SampleOutput([])
        device = logits.device
        logits = logits.float()
        want_lp = any(p.logprobs is not None for p in params)
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
            kmax = max(p.logprobs or 0 for p in params)
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
