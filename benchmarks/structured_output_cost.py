"""What structured output costs per decode step: the grammar mask (xgrammar's fill_next_token_bitmask for every
constrained row + apply_token_bitmask_inplace on the batch) and the matchers' accept_token, against the same
decode step unconstrained.

    python benchmarks/structured_output_cost.py [--arch qwen3] [--size 1m] [--batches 8 32] [--steps 64]

A tiny random checkpoint (made here, offline). For each batch size B: B requests (prompt 32 tokens, sampled at
temperature 1 with a seed each) are prefilled, then `--steps` decode steps with all B rows decoding are timed,
once unconstrained and once with every row under a JSON schema whose one string field keeps every row inside the
grammar for the whole measurement (300 characters of [a-z ]), so no row finishes early. Each is run --repeats
times, alternating, and the run with the fastest median step is kept. Prints ms per step (whole engine step), the mask's ms per step (allocate + fill + apply), accept_token's ms per step, and the
ratios. The tiny model has a 448-id vocabulary: the fill cost grows with the vocabulary (a real 150k vocabulary
costs more per row), the model's step with its size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tandem.engine.sampler as sampler_mod  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.structured_output import RequestGrammar, StructuredOutput  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "pattern": "^[a-z ]{300}$"}},
          "required": ["text"], "additionalProperties": False}


class _Timer:
    """Wraps a function (or method: it binds like one) and adds its wall time to `total`."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t

    def __get__(self, obj, objtype=None):
        return self if obj is None else (lambda *a, **k: self(obj, *a, **k))


def run(path: str, batch: int, steps: int, constrained: bool, warmup: int = 4) -> dict[str, float]:
    eng = LLMEngine(EngineConfig(model=path, enable_prefix_caching=False, max_num_seqs=batch,
                                 max_num_batched_tokens=max(2048, 32 * batch)))
    so = StructuredOutput.json_schema(SCHEMA) if constrained else None
    g = torch.Generator().manual_seed(0)
    vocab = eng.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(3, vocab - 64, (32,), generator=g).tolist()
        eng.add_request(None, prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=steps + warmup + 8,
                                                     ignore_eos=True, structured_output=so))
    mask = _Timer(sampler_mod.apply_grammar_bitmask)
    accept = _Timer(RequestGrammar.accept)
    sampler_mod.apply_grammar_bitmask, RequestGrammar.accept = mask, accept
    try:
        while eng.stats.prefill_tokens < 32 * batch:            # prefill everything (and sample first tokens)
            eng.step()
        for _ in range(warmup):
            eng.step()
        times, masks, accepts = [], [], []
        for _ in range(steps):
            d0, p0, m0, a0 = eng.stats.decode_tokens, eng.stats.prefill_tokens, mask.total, accept.total
            t = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t
            assert eng.stats.decode_tokens - d0 == batch and eng.stats.prefill_tokens == p0, "batch not full"
            times.append(dt)
            masks.append(mask.total - m0)
            accepts.append(accept.total - a0)
    finally:
        sampler_mod.apply_grammar_bitmask, RequestGrammar.accept = mask.fn, accept.fn
    return {"step_ms": 1e3 * statistics.median(times), "mask_ms": 1e3 * statistics.median(masks),
            "accept_ms": 1e3 * statistics.median(accepts)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--size", default="1m")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; the fastest median is kept")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, arch=args.arch, size=args.size, seed=0)
        print(f"tiny {args.arch}-{args.size}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"median of {args.steps} decode steps, best of {args.repeats} runs")
        print(f"{'batch':>5} {'free ms/step':>12} {'json ms/step':>12} {'ratio':>6} {'mask ms':>8} "
              f"{'mask/free':>9} {'accept ms':>9} {'mask us/row':>11}")
        run(tmp, args.batches[0], 8, constrained=True)          # warm-up: first engine, first compile
        for b in args.batches:
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for _ in range(args.repeats):
                for c in (False, True):
                    runs[c].append(run(tmp, b, args.steps, constrained=c))
            free = min(runs[False], key=lambda r: r["step_ms"])
            js = min(runs[True], key=lambda r: r["step_ms"])
            print(f"{b:>5} {free['step_ms']:>12.3f} {js['step_ms']:>12.3f} {js['step_ms'] / free['step_ms']:>6.2f} "
                  f"{js['mask_ms']:>8.3f} {js['mask_ms'] / free['step_ms']:>9.2f} {js['accept_ms']:>9.3f} "
                  f"{1e3 * js['mask_ms'] / b:>11.1f}")


if __name__ == "__main__":
    main()
