"""Accuracy and tokens committed per step of a block-diffusion model on the held-out task examples.

`evaluate` decodes each example's prompt with the KV-cached loop (batched) and reports, per task and overall,
exact-match accuracy (the output up to its EOS equals the answer, and it did stop) and the tokens committed per
denoise step: committed / steps counts every committed position (the EOS and the EOS padding after it in the last
block included, as a serving engine commits them), output / steps only the tokens returned. Benchmarks reuse it.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tandem.engine.diffusion.generate import DiffusionOutput, generate_cached
from tandem.engine.diffusion.tasks import PREDICTABLE, Example, eval_set
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.sampling_params import SamplingParams

Decoder = Callable[[torch.nn.Module, list[list[int]], SamplingParams, DllmConfig], list[DiffusionOutput]]


@dataclass
class TaskScore:
    """One task's results."""

    n: int = 0
    correct: int = 0
    steps: int = 0
    committed: int = 0
    output_tokens: int = 0

    @property
    def accuracy(self) -> float | None:
        """Exact-match rate (None for tasks without one right answer)."""
        return self.correct / self.n if self.n else None

    @property
    def committed_per_step(self) -> float:
        """Positions committed per denoise step."""
        return self.committed / max(1, self.steps)

    @property
    def output_per_step(self) -> float:
        """Returned tokens per denoise step."""
        return self.output_tokens / max(1, self.steps)


@dataclass
class EvalReport:
    """Per-task scores, the overall score, and the decoding settings they were measured with."""

    tasks: dict[str, TaskScore]
    overall: TaskScore                 # every example (tokens per step)
    predictable: TaskScore             # the examples with one right answer (accuracy)
    settings: dict[str, Any] = field(default_factory=dict)
    exact: list[bool] = field(default_factory=list)      # each example's exact match, in the examples' order

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for JSON and tables."""
        def one(s: TaskScore, exact: bool) -> dict[str, Any]:
            """One row of numbers."""
            return {"n": s.n, "accuracy": round(s.accuracy, 4) if exact and s.accuracy is not None else None,
                    "committed_per_step": round(s.committed_per_step, 3),
                    "output_per_step": round(s.output_per_step, 3), "steps": s.steps}
        overall = one(self.overall, False)
        overall["accuracy"] = one(self.predictable, True)["accuracy"]
        return {"settings": self.settings, "overall": overall,
                "tasks": {t: one(s, t in PREDICTABLE) for t, s in self.tasks.items()}}

    def table(self) -> str:
        """A plain-text table: task, n, exact match, committed / output tokens per step."""
        d = self.as_dict()
        lines = [f"{'task':<10}{'n':>5}{'exact':>8}{'commit/step':>13}{'output/step':>13}"]
        for name, r in [*d["tasks"].items(), ("all", d["overall"])]:
            acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
            lines.append(f"{name:<10}{r['n']:>5}{acc:>8}{r['committed_per_step']:>13.2f}{r['output_per_step']:>13.2f}")
        return "\n".join(lines)


def exact_match(out: DiffusionOutput, answer: str, decode: Any, eos_ids: Sequence[int]) -> bool:
    """Whether the output stopped at an EOS and the text before it is the answer."""
    ids = out.token_ids
    if out.finish_reason != "stop" or not ids or ids[-1] not in eos_ids:
        return False
    return decode(ids[:-1]) == answer


def evaluate(model: torch.nn.Module, tokenizer: Any, examples: Sequence[Example], cfg: DllmConfig | None = None,
             params: SamplingParams | None = None, batch_size: int = 64, decode: Decoder | None = None) -> EvalReport:
    """Decode every example (greedy, 64 new tokens, unless `params`) and score it; `tokenizer` is a tokenizers one.

    `decode(model, prompts, params, cfg)` is the batched loop (default generate_cached; e.g. a partial of
    refresh.generate_refresh for Refresh/Reuse phases over sparse KV).
    """
    cfg = cfg or DllmConfig()
    decode = decode or generate_cached
    params = params or SamplingParams(temperature=0.0, max_tokens=64)
    eos = list(model.config.eos_token_ids)
    scores: dict[str, TaskScore] = defaultdict(TaskScore)
    total, predictable = TaskScore(), TaskScore()
    exact: list[bool] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        outs = decode(model, [tokenizer.encode(e.prompt).ids for e in chunk], params, cfg)
        for ex, out in zip(chunk, outs):
            ok = exact_match(out, ex.answer, tokenizer.decode, eos)
            exact.append(ok)
            for s in (scores[ex.task], total, *((predictable,) if ex.task in PREDICTABLE else ())):
                s.n += 1
                s.correct += int(ok)
                s.steps += out.num_steps
                s.committed += sum(out.commits_per_step)
                s.output_tokens += len(out.token_ids)
    block = cfg.block_length(model.diffusion_block_size)
    settings = {"block_length": block, "strategy": cfg.dllm_unmasking_strategy,
                "denoising_steps": cfg.dllm_denoising_steps or block,
                "threshold": cfg.dllm_confidence_threshold, "temperature": params.temperature,
                "max_tokens": params.max_tokens}
    return EvalReport(dict(scores), total, predictable, settings, exact)


def evaluate_checkpoint(path: str | os.PathLike, n_per_task: int = 100, cfg: DllmConfig | None = None,
                        seed: int = 1234, record: bool = True) -> EvalReport:
    """Load an SDAR checkpoint (float32), evaluate it on n_per_task held-out examples of each task (one thread).

    The default decoding is the documented one: greedy, block 32, low_confidence_dynamic at threshold 0.9. With
    `record`, the report is added to the checkpoint's training.json under "eval" when that file exists.
    """
    from tokenizers import Tokenizer as HFTokenizer

    from tandem.engine.loader import load_model

    p = Path(path)
    model, _ = load_model(p, dtype="float32")
    tok = HFTokenizer.from_file(str(p / "tokenizer.json"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = evaluate(model, tok, eval_set(n_per_task, seed), cfg or DllmConfig(dllm_confidence_threshold=0.9))
    finally:
        torch.set_num_threads(threads)
    info = p / "training.json"
    if record and info.is_file():
        d = json.loads(info.read_text())
        d["eval"] = {"examples_per_task": n_per_task, "seed": seed, **report.as_dict()}
        info.write_text(json.dumps(d, indent=2) + "\n")
    return report
