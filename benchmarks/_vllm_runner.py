"""One offline vLLM run for benchmarks/engine_vs_vllm.py, executed by the vLLM virtualenv's python.

    .vllm-venv/bin/python benchmarks/_vllm_runner.py SPEC.json OUT.json

SPEC (written by engine_vs_vllm.py): model, prompts (token ids), output_len and the engine limits. The thread
count and the KV space come from the environment (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE), set by the
caller. Writes OUT: the time the engine was ready (Unix seconds), the generate() wall time, the output token
ids, the CPU seconds the process tree spent in generate(), the versions and what the run actually ran at (the vLLM kernel libraries its processes mapped, torch's CPU
capability, the attention variant vLLM picks for this model). Imports nothing from tandem: tandem is not installed
in that virtualenv.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

from proc_cpu import cpu_seconds_since, tree_cpu_seconds   # benchmarks/ is this script's directory


def kernel_libraries() -> list[str]:
    """The vllm/_C*.so files mapped by this process and its descendants (vLLM's engine core runs in a child)."""
    import psutil

    pids = [os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))]
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found.update(re.findall(r"vllm/(_C[A-Za-z0-9_]*)\.abi3\.so", f.read()))
        except OSError:
            pass
    return sorted(found)


def ran_at() -> dict:
    """What this vLLM run ran at, as far as it can be seen from here."""
    import torch

    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        attn = _get_attn_isa(torch.float32, 32, 64)
    except Exception as e:  # noqa: BLE001 - a record, not a requirement
        attn = f"unknown ({type(e).__name__})"
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "kernel_libraries": kernel_libraries(),
            "attention_isa": attn, "avx512_seen": torch.cpu._is_avx512_supported()}


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0,
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=spec["max_num_seqs"], block_size=spec["block_size"],
              enable_prefix_caching=True)
    ready = time.time()
    n = spec["output_len"]
    # min_tokens = max_tokens masks EOS for every generated token, as tandem's min_tokens does
    sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:16])],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)   # warm-up
    cpu0 = tree_cpu_seconds()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds_since(cpu0)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    result = {"ran_at": ran_at(), "ready_unix": ready, "wall_s": wall, "cpu_s": cpu, "output_tokens": sum(map(len, ids)), "token_ids": ids,
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
              "torch_threads": torch.get_num_threads()}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
