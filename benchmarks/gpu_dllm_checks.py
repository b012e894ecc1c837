"""CUDA checks of the diffusion and memory paths for a session lent a GPU; JSON to --out.

    python benchmarks/gpu_dllm_checks.py --out DIR

1. The trained tiny SDAR model (tandem/engine/diffusion/assets/tiny-sdar) on CUDA: the full-recompute reference loop
   and the KV-cached batched loop give the same tokens (on the CUDA path), their agreement
   with the CPU's tokens, held-out accuracy and tokens committed per step, and the step time.
2. The block-diffusion engine (through the worker core) on CUDA: block, chunk 8 and elastic, tokens against the
   cached loop's and output tokens/s at batch 1, 8 and 64.
3. The logit-aware memory profile on CUDA: a tiny Qwen3 body with Qwen3's 151,936-id
   vocabulary, profiled monolithic and with max_num_logits, the KV pool each leaves under gpu_memory_utilization;
   then the worst-case batch is run again on the live engine and its allocator peak compared with the profile's
   reserved activation memory (measured peak <= profiled peak + guard).
4. The token budget as a hard cap (`budget`): block, chunk 16 and elastic at 128 sequences under 1,024 rows a step
   (uncapped, the block would run 4,224): the most rows a step held, and the allocator's peak over the run against
   the activation memory the profile reserved.
Runs on CPU too (then it only checks the code runs); one GPU, about a minute.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.diffusion.evaluate import evaluate
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.diffusion.generate import generate_cached, generate_reference
from tandem.engine.diffusion.tasks import eval_set
from tandem.engine.loader import load_model
from tandem.engine.memory_profile import guard_bytes, measure_peak, worst_case_batch
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tiny_model import widen_vocab

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
MIB = 1 << 20


def sdar_checks(device: torch.device, n: int) -> dict:
    """Reference vs cached tokens on `device`, against the CPU's, with accuracy and step time."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(ASSET / "tokenizer.json"))
    examples = eval_set(max(1, n // 6))
    prompts = [tok.encode(e.prompt).ids for e in examples]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    out: dict = {}
    tokens = {}
    for dev, dtype in ((torch.device("cpu"), torch.float32), (device, torch.float32), (device, torch.bfloat16)):
        if dev.type == "cpu" and "cpu" in tokens:
            continue
        model, _ = load_model(str(ASSET), dtype_for=lambda _c, d=dtype: d, device=dev)
        key = f"{dev.type}-{str(dtype).split('.')[-1]}"
        t0 = time.perf_counter()
        ref = [generate_reference(model, p, params, DllmConfig(dllm_confidence_threshold=0.9)) for p in prompts]
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        cached = generate_cached(model, prompts, params, DllmConfig(dllm_confidence_threshold=0.9))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t_cached = time.perf_counter() - t0
        same = sum(a.token_ids == b.token_ids for a, b in zip(ref, cached))
        steps = sum(c.num_steps for c in cached)
        res = evaluate(model, tok, examples, DllmConfig(dllm_confidence_threshold=0.9))
        tokens[key] = [c.token_ids for c in cached]
        out[key] = {"reference_equals_cached": f"{same}/{len(prompts)}", "reference_s": round(t_ref, 3),
                    "cached_batched_s": round(t_cached, 3), "cached_steps": steps,
                    "committed_per_step": round(res.overall.committed_per_step, 3),
                    "accuracy": res.predictable.accuracy}
        if dev.type == "cpu":
            tokens["cpu"] = tokens[key]
    for key, toks in tokens.items():
        if key.startswith("cuda"):
            out[key]["same_as_cpu_float32"] = f"{sum(a == b for a, b in zip(toks, tokens['cpu']))}/{len(toks)}"
    return out


def _drain(eng) -> tuple[int, float]:  # noqa: ANN001 - an LLMEngine
    """Step the engine until every request ends: the output tokens and the seconds it took."""
    t0 = time.perf_counter()
    toks = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                toks += len(o.outputs[0].token_ids)
    return toks, time.perf_counter() - t0


def engine_checks(device: torch.device, n: int) -> dict:
    """The diffusion engine (through the worker core) on `device`: each mode's tokens against the cached loop's on
    the same device, and output tokens/s at a few batch sizes (64 tokens each, ignore_eos)."""
    from tokenizers import Tokenizer as HFTokenizer

    from tandem.engine.llm_engine import LLMEngine
    tok = HFTokenizer.from_file(str(ASSET / "tokenizer.json"))
    prompts = [tok.encode(e.prompt).ids for e in eval_set(max(1, n // 6))]
    model, _ = load_model(str(ASSET), dtype_for=lambda _c: torch.float32, device=device)
    cfg = DllmConfig(dllm_confidence_threshold=0.9)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    out: dict = {}
    for chunk in ("block", "8", "elastic"):
        def engine(b: int) -> LLMEngine:
            return LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device=str(device), dllm_chunk=chunk,
                                          max_num_seqs=max(b, 1), max_num_batched_tokens=4096, max_model_len=512,
                                          num_kv_blocks=1024, enforce_eager=True))
        eng = engine(len(prompts))
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        got: dict = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        entry: dict = {}
        if chunk != "elastic":
            ref = generate_cached(model, prompts, params, cfg, chunk=None if chunk == "block" else int(chunk))
            entry["same_as_loop"] = f"{sum(got[str(i)] == r.token_ids for i, r in enumerate(ref))}/{len(prompts)}"
        speed = {}
        for b in (1, 8, 64):
            eng = engine(b)
            fixed = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            for i in range(b):
                eng.add_request(str(i), prompts[i % len(prompts)], fixed)
            toks, secs = _drain(eng)
            speed[str(b)] = round(toks / secs, 1)
        entry["tokens_per_s"] = speed
        out[chunk] = entry
    return out


def budget_checks(device: torch.device, seqs: int, tokens: int, sampled: bool = False) -> dict:
    """max_num_batched_tokens caps every diffusion step (Optimus's modes under dLLM-Serve's memory profile): `seqs`
    requests (64 tokens, ignore_eos) decoded by the block (BD32), chunk 16 and elastic under a budget of `tokens`
    rows, the most rows any step held, and on CUDA the allocator's peak over the whole run on top of what the engine
    held after start, against the activation memory its memory profile reserved (peak + guard). `sampled`: every
    request samples (temperature 1, top-k 50, top-p 0.9, seeded), the profile's assumption, instead of greedy."""
    from tokenizers import Tokenizer as HFTokenizer

    from tandem.engine.llm_engine import LLMEngine
    tok = HFTokenizer.from_file(str(ASSET / "tokenizer.json"))
    prompts = [tok.encode(e.prompt).ids for e in eval_set(max(1, seqs // 6))]
    fixed = (SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0, max_tokens=64, ignore_eos=True) if sampled
             else SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    cuda = device.type == "cuda"
    out: dict = {"seqs": seqs, "max_num_batched_tokens": tokens, "sampled": sampled}
    for chunk in ("block", "16", "elastic"):
        extra = dict(memory_profile=True, gpu_memory_utilization=0.1) if cuda else dict(num_kv_blocks=seqs * 8)
        eng = LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device=str(device), dllm_chunk=chunk,
                                     max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=512,
                                     enforce_eager=True, **extra))
        for i in range(seqs):
            eng.add_request(str(i), prompts[i % len(prompts)], fixed)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        toks, secs = _drain(eng)
        entry = {"output_tokens": toks, "seconds": round(secs, 2),
                 "max_step_rows": max(eng.stats.iteration_tokens), "steps": eng.stats.steps,
                 "within_budget": max(eng.stats.iteration_tokens) <= tokens}
        if cuda:
            prof = eng.runner.memory
            peak = torch.cuda.max_memory_allocated() - base
            entry.update(run_peak_mib=round(peak / MIB, 1), reserved_mib=round(prof.reserved_bytes / MIB, 1),
                         within_reserved=peak <= prof.reserved_bytes)
        out[chunk] = entry
        del eng
        if cuda:
            torch.cuda.empty_cache()
    return out


def memory_checks(device: torch.device, tmp: Path, tokens: int, seqs: int, cap: int) -> dict:
    """The profile monolithic and capped, and the worst-case batch's measured peak on the live engine."""
    path = widen_vocab(tmp / "v152k", 151936, 0)
    out = {}
    for name, max_logits in (("monolithic", None), ("decomposed", cap)):
        cfg = EngineConfig(model=path, device=str(device), max_num_batched_tokens=tokens, max_num_seqs=seqs,
                           max_num_logits=max_logits, memory_profile=True, gpu_memory_utilization=0.5,
                           max_model_len=4096, enforce_eager=True)
        t0 = time.perf_counter()
        r = ModelRunner(cfg)
        start_s = time.perf_counter() - t0
        m = r.memory
        batch = worst_case_batch(tokens, seqs, 4096, r.model_config.vocab_size, cfg.block_size,
                                 r.sampler.eos_token_ids, device)
        peak, _ = measure_peak(lambda r=r: r.execute(batch), device)
        out[name] = {"summary": m.summary(), "start_s": round(start_s, 2),
                     "profiled_peak_mib": round(m.peak_bytes / MIB, 1),
                     "reserved_mib": round(m.reserved_bytes / MIB, 1),
                     "guard_mib": round(guard_bytes(m.peak_bytes) / MIB, 1),
                     "measured_worst_case_peak_mib": round(peak / MIB, 1),
                     "within_reserved": peak <= m.reserved_bytes,
                     "kv_pool_mib": round(r.kv_pool_bytes / MIB, 1), "kv_gain_mib": round(m.kv_gain_bytes / MIB, 1)}
        del r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-logits", type=int, default=32)
    ap.add_argument("--budget-seqs", type=int, default=128)
    ap.add_argument("--budget-tokens", type=int, default=1024)
    ap.add_argument("--budget-sampled", action="store_true", help="the budget check's requests sample (top-k/p)")
    ap.add_argument("--checks", default="sdar,engine,budget,memory", help="which checks, comma-separated")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in (("sdar", lambda: sdar_checks(device, a.prompts)),
                     ("engine", lambda: engine_checks(device, a.prompts)),
                     ("budget", lambda: budget_checks(device, a.budget_seqs, a.budget_tokens,
                                                                 a.budget_sampled)),
                     ("memory", lambda: memory_checks(device, Path(tempfile.mkdtemp()), a.tokens, a.max_num_seqs,
                                                      a.max_num_logits))):
        if name not in a.checks.split(","):
            continue
        try:
            res[name] = fn()
        except Exception as e:          # noqa: BLE001 - one check's failure must not hide the others' results
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({name: res.get(name)}, indent=1), flush=True)
    (out / "gpu_dllm_checks.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
