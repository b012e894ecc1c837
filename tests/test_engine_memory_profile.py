"""Logit-aware memory profiling (tandem/engine/memory_profile.py): the worst-case dummy step's measured activation peak
bounds a real worst-case step, the KV pool is budget - weights - buffers - guarded peak, the logit cap enlarges it by
the predicted amount, and the figures reach the log and /metrics."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tandem.cli.main import main  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError, wants_memory_profile  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.memory_profile import (  # noqa: E402
    GUARD_MIN_BYTES, LiveBytes, MemoryProfile, guard_bytes, memory_report, worst_case_batch,
)
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model, widen_vocab  # noqa: E402
from tandem.runtime.client import BackendStats, add_memory_reports  # noqa: E402

VOCAB = 32768                 # a real vocabulary (SDAR's, Llama 2's) on the 1m model's body (hidden 128, 4 layers)
T, S, CAP, MAX_LEN = 256, 64, 8, 512
BUDGET = 256 << 20
MIB = 1 << 20


pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py


def vocab_model(out: Path, vocab: int, seed: int = 0) -> str:
    """The tiny Qwen3 with a real-sized vocabulary (tandem.engine.tiny_model.widen_vocab)."""
    return widen_vocab(out, vocab, seed)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> str:
    return vocab_model(tmp_path_factory.mktemp("vocab32k"), VOCAB)


@pytest.fixture(scope="module")
def engines(big):
    """The same byte budget, monolithic and with max_num_logits=8 (profile on: cpu_memory_budget_bytes)."""
    kw = dict(max_num_batched_tokens=T, max_num_seqs=S, max_model_len=MAX_LEN, cpu_memory_budget_bytes=BUDGET)
    return {cap: LLMEngine(EngineConfig(model=big, max_num_logits=cap, **kw)) for cap in (None, CAP)}


def _allocator_peak(fn) -> int:
    """An independent witness: the peak of the CPU allocator's live bytes (torch.profiler's memory events, which
    include what kernels allocate inside themselves) while fn runs."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_live_bytes_counts_new_storages_until_they_die():
    """Protects the CPU measure: op outputs counted while alive; views, in-place and out= results are not new."""
    a = torch.zeros(1 << 20)                                  # 4 MiB before the mode: not counted
    mode = LiveBytes()
    with mode:
        b = a * 2                                             # +4 MiB
        c = b.view(256, -1)                                   # a view: +0
        a.mul_(3)                                             # in place: +0
        torch.add(a, 1, out=b)                                # out=: +0
        d = c + 1                                             # +4 MiB: peak 8 MiB
        del b, c
        e = d.relu()                                          # d, e live: 8 MiB
        del d
        f = e.sum()                                           # +4 bytes
    assert mode.peak == 8 * MIB and mode.live == 4 * MIB + 4
    del e, f


def test_worst_case_batch_is_at_the_scheduler_limits():
    """Protects what the profile runs: max_num_batched_tokens tokens, min(max_num_seqs, tokens) sampled rows, prefill
    chunks at the end of a max_model_len context (split when longer than it), prompt logprobs, one scratch block."""
    b = worst_case_batch(100, 8, 64, VOCAB, 16)
    assert b.query_lens == [47, 47] + [1] * 6 and sum(b.query_lens) == 100
    assert b.seq_lens == [64, 64] + [1] * 6
    assert b.sample_rows == list(range(8)) and len(b.params) == len(b.generators) == 8
    assert [len(s.targets) for s in b.prompt_logprobs] == [47, 47] and b.prompt_logprobs[0].k == 20
    assert {blk for row in b.block_tables for blk in row} == {0} and len(b.block_tables[0]) == 4
    p = b.params[0]
    assert (p.top_k, p.top_p, p.min_p, p.logprobs, p.repetition_penalty) == (50, 0.9, 0.05, 20, 1.1)
    small = worst_case_batch(4, 10, 64, VOCAB, 16)                 # more sequences allowed than tokens
    assert small.query_lens == [1, 1, 1, 1] and len(small.sample_rows) == 4


def test_a_real_worst_case_step_never_exceeds_the_profiled_budget(engines):
    """Protects the profiled peak as an upper bound: a real step at the limits (256 tokens, 64 rows sampled with top-k/top-p,
    penalties, 20 logprobs, prompt logprobs) measures at most the profiled peak, and the CPU allocator's own count
    (kernel-internal scratch included, measured on the same step) at most the peak plus its guard band, monolithic
    and decomposed."""
    hungry = dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=20, repetition_penalty=1.1,
                  frequency_penalty=0.5, presence_penalty=0.5, seed=1, max_tokens=2, ignore_eos=True)
    for cap, eng in engines.items():
        prof = eng.runner.memory
        eng.add_request("long", [(7 * j) % 400 + 1 for j in range(T - S + 1)],
                        SamplingParams(prompt_logprobs=20, **hungry))
        for i in range(S - 1):
            eng.add_request(f"r{i}", [i + 1], SamplingParams(**hungry))
        mode, outs = LiveBytes(), []

        def step(mode=mode, outs=outs, eng=eng) -> None:
            with mode:
                outs.extend(eng.step())
        witnessed = _allocator_peak(step)
        assert len(outs) == S and eng.stats.iteration_tokens == {T: 1}      # the whole budget in one step
        assert mode.peak <= prof.peak_bytes, (cap, mode.peak, prof.peak_bytes)
        assert witnessed <= prof.reserved_bytes, (cap, witnessed, prof.reserved_bytes)
        print(f"max_num_logits={cap}: profiled peak {prof.peak_bytes} (+ guard {guard_bytes(prof.peak_bytes)}), "
              f"real step {mode.peak} (dispatch), {witnessed} (allocator)")
        while eng.has_unfinished_requests():
            eng.step()


def test_the_logit_cap_enlarges_the_kv_pool_by_the_predicted_amount(engines):
    """Protects the pools sized from the profile and the sizing rule: each pool is (budget - weights - persistent buffers -
    peak - guard) // block bytes; with max_num_logits=8 the pool is larger by the difference of the guarded peaks,
    which exceeds the 56 rows x 32768 x 4 bytes of logits the cap never holds."""
    mono, dec = engines[None].runner, engines[CAP].runner
    per_block = mono.kv_pool_bytes // mono.num_blocks
    for r in (mono, dec):
        m = r.memory
        assert m.budget_bytes == BUDGET and m.used_bytes == m.weight_bytes + m.persistent_bytes
        assert r.num_blocks == (BUDGET - m.used_bytes - m.peak_bytes - guard_bytes(m.peak_bytes)) // per_block
    assert mono.memory.decomposed_peak_bytes is None
    assert dec.memory.monolithic_peak_bytes == mono.memory.monolithic_peak_bytes      # the same step, measured twice
    gain = dec.memory.kv_gain_bytes
    assert gain >= (S - CAP) * VOCAB * 4
    assert abs((dec.num_blocks - mono.num_blocks) * per_block - gain) < per_block
    from tandem.engine.models.layers import ONEDNN_LINEAR, Linear
    if ONEDNN_LINEAR:                  # profiling under the dispatch mode left every linear on its packed weight
        assert all(m._packed is not None for r in (mono, dec) for m in r.model.modules() if isinstance(m, Linear))


def test_profile_options_are_validated_and_an_explicit_pool_still_wins(big, tmp_path):
    """Protects the options: integers >= 1, memory_profile a bool or None, a CPU budget needs the profile; when to
    profile; num_kv_blocks/kv_cache_memory_bytes win over the budget; a budget too small is a one-line EngineError."""
    for name, bad in (("cpu_memory_budget_bytes", 0), ("cpu_memory_budget_bytes", True),
                      ("cpu_memory_budget_bytes", 1.5)):
        with pytest.raises(EngineError, match=f"{name} must be an integer >= 1"):
            EngineConfig(model=big, **{name: bad})
    with pytest.raises(EngineError, match="memory_profile must be"):
        EngineConfig(model=big, memory_profile="yes")
    with pytest.raises(EngineError, match="needs memory_profile"):
        EngineConfig(model=big, cpu_memory_budget_bytes=BUDGET, memory_profile=False)
    cpu = torch.device("cpu")
    assert not wants_memory_profile(EngineConfig(model=big), cpu)
    assert wants_memory_profile(EngineConfig(model=big, cpu_memory_budget_bytes=BUDGET), cpu)
    assert not wants_memory_profile(EngineConfig(model=big, cpu_memory_budget_bytes=BUDGET, num_kv_blocks=9), cpu)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64)
    forced = LLMEngine(EngineConfig(model=big, memory_profile=True, num_kv_blocks=9, max_num_logits=2, **kw))
    assert forced.runner.num_blocks == 9 and forced.runner.memory.budget_bytes is None
    assert forced.runner.memory.decomposed_peak_bytes is not None
    assert LLMEngine(EngineConfig(model=big, **kw)).runner.memory is None           # the default: no profile
    with pytest.raises(EngineError, match="leaves no room for one KV block") as e:
        LLMEngine(EngineConfig(model=big, cpu_memory_budget_bytes=24 * MIB, **kw))
    assert len(str(e.value).splitlines()) == 1 and "max_num_logits" in str(e.value)


def test_the_profile_is_logged_and_exported_on_metrics(tmp_path, caplog):
    """Protects the reporting: a start log line with both peaks, the /metrics gauges tandem:activation_peak_bytes
    {logits=monolithic|decomposed}, tandem:activation_budget_bytes and tandem:kv_cache_pool_bytes, and the cluster's
    folding of several workers' figures."""
    from tandem.runtime.async_llm import AsyncLLM
    from tandem.server.metrics import ServerMetrics
    make_tiny_model(tmp_path, arch="qwen3", size="1m", seed=1)
    with caplog.at_level(logging.INFO, logger="tandem.engine.model_runner"):
        client = AsyncLLM.from_model(str(tmp_path), served_model_name="t", max_num_batched_tokens=64, max_num_seqs=8,
                                     max_model_len=128, max_num_logits=2, cpu_memory_budget_bytes=64 * MIB)
    try:
        text = ServerMetrics(client, "t").render().decode()
    finally:
        asyncio.run(client.shutdown())
    m = client.engine.runner.memory
    line = next(r.getMessage() for r in caplog.records if "memory profile" in r.getMessage())
    assert "monolithic" in line and "decomposed (max_num_logits=2)" in line and "KV pool" in line

    def value(key: str) -> float:
        return float(next(x for x in text.splitlines() if x.startswith(key + " ")).rsplit(" ", 1)[1])
    assert value('tandem:activation_peak_bytes{logits="monolithic",model_name="t"}') == m.monolithic_peak_bytes
    assert value('tandem:activation_peak_bytes{logits="decomposed",model_name="t"}') == m.decomposed_peak_bytes
    assert value('tandem:activation_budget_bytes{model_name="t"}') == m.reserved_bytes
    assert value('tandem:kv_cache_pool_bytes{model_name="t"}') == client.engine.runner.kv_pool_bytes > 0
    # several workers: pools add up, peaks and budgets are the largest; a worker without a profile adds its pool only
    out = BackendStats()
    prof = MemoryProfile("x", 1, 1, 0, 2, 10, 0, 500, 300, 0.0)
    add_memory_reports(out, [memory_report(prof, 1000), memory_report(None, 700)])
    assert out.kv_cache_pool_bytes == 1700 and out.activation_peak_bytes == {"monolithic": 500, "decomposed": 300}
    assert out.activation_budget_bytes == 300 + GUARD_MIN_BYTES


@pytest.mark.parametrize("flag,value,needle", [("--cpu-memory-budget", "12X", "expected bytes"),
                                               ("--cpu-memory-budget", "0", "must be >= 1 byte"),
                                               ("--gpu-memory-utilization", "1.5", "must be in (0, 1]"),
                                               ("--gpu-memory-utilization", "nan", "must be in (0, 1]")])
def test_serve_memory_flags_fail_in_one_line(tmp_path, capsys, flag, value, needle):
    """Protects the CLI: a bad budget or utilization is one line on stderr and exit status 2."""
    rc = main(["serve", "--model", str(tmp_path), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("tandem: error: ")
    assert flag in err[0] and needle in err[0]


def test_serve_passes_the_memory_flags_to_the_engines(tmp_path):
    """Protects the flags' path: --cpu-memory-budget 3G and --gpu-memory-utilization 0.5 reach EngineConfig."""
    from tandem.cli import serve_cmd
    from tandem.cli.common import Parser, byte_size
    make_tiny_model(tmp_path, arch="qwen3", size="1m", seed=1)
    p = Parser(prog="tandem")
    serve_cmd.add_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--model", str(tmp_path), "--cpu-memory-budget", "3G",
                         "--gpu-memory-utilization", "0.5", "--max-num-logits", "16"])
    eng = serve_cmd._cluster_config(args).engine_args
    assert (eng["cpu_memory_budget_bytes"], eng["gpu_memory_utilization"], eng["max_num_logits"]) == (3 << 30, 0.5, 16)
    assert byte_size("512MiB") == 512 << 20 and byte_size("1048576") == 1 << 20
    cfg = EngineConfig(model=str(tmp_path), **eng)
    assert cfg.cpu_memory_budget_bytes == 3 << 30


def test_the_cluster_takes_only_valid_memory_figures_from_a_worker():
    """Protects the runtime's trust rule: a worker's Ready info is validated before /metrics shows it."""
    from tandem.runtime.cluster import memory_info
    info = {"memory": {"kv_cache_pool_bytes": 5, "neg": -1, "flag": True, "text": "7", 3: 4, "f": 1.5}}
    assert memory_info(info) == {"kv_cache_pool_bytes": 5}
    assert memory_info({}) == {} and memory_info({"memory": [1, 2]}) == {}
