"""Tensor parallelism in the engine on tiny checkpoints, two ranks on CPU (gloo): greedy tokens identical to one rank
(Qwen3, Llama, the trained SDAR), seeded sampling within the documented float-order tolerance, one-line errors for a
split the model or the machine cannot take, and no rank process left behind after an error, a dead rank or a
killed driver."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.diffusion.tasks import eval_set  # noqa: E402
from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.parallel import group  # noqa: E402
from tandem.engine.parallel.driver import TensorParallelError  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tp_helpers import needs_two_cores  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SDAR = ROOT / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(vocab: int, lens=(5, 17, 33), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 8, (n,), generator=g).tolist() for n in lens]


def _ranks_left() -> list[psutil.Process]:
    """This process's descendants other than multiprocessing's fork server and resource tracker (which live as long
    as this process)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
            if "forkserver" not in cmd and "resource_tracker" not in cmd and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(path, arch=request.param, size="1m", seed=1)
    return str(path)


@needs_two_cores
def test_two_ranks_give_one_ranks_greedy_tokens_and_seeded_samples(tiny):
    """Protects the sharding (heads, KV heads, MLP, vocabulary; Llama's KV heads 2 split over 2 ranks) and the
    per-call broadcast: greedy tokens at tp=2 equal tp=1's token for token; seeded sampling (temperature 0.8, top-p
    0.95) gives the same tokens here too (the all-reduce's summation order moves logits by about 1e-6)."""
    one = LLM(tiny)
    vocab = one.engine.model_config.vocab_size
    prompts = _prompts(vocab)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    ref_greedy = [o.token_ids for o in one.generate(prompts, GREEDY)]
    ref_seeded = [o.token_ids for o in one.generate(prompts, seeded)]
    with LLM(tiny, tensor_parallel_size=2) as two:
        assert len(two.engine.runner.group.pids) == 1
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == ref_greedy
        assert [o.token_ids for o in two.generate(prompts, seeded)] == ref_seeded
    assert _ranks_left() == []


@needs_two_cores
def test_sdar_two_ranks_equal_one_rank_greedy():
    """Protects block diffusion under TP (its block-causal attention is the same sharded layers, its windows' inputs
    broadcast like the AR steps', swaps on every rank): the trained tiny SDAR's greedy outputs at tp=2 equal tp=1's
    on one held-out example of each of three tasks."""
    from tandem.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(str(SDAR))
    prompts = [tok.encode(e.prompt, add_special_tokens=False) for e in eval_set(1)[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref = [o.token_ids for o in LLM(str(SDAR), dtype="float32").generate(prompts, params)]
    assert any(ref)
    with LLM(str(SDAR), dtype="float32", tensor_parallel_size=2) as two:
        assert [o.token_ids for o in two.generate(prompts, params)] == ref
    assert _ranks_left() == []


def test_a_split_the_model_or_machine_cannot_take_is_one_line(tiny, monkeypatch):
    """Protects the checks made before any rank starts: tp=3 on 4 attention heads (cores faked to 8), tp above the
    CPU cores, a non-integer tp, tp with dLLM-Serve phases; each a one-line EngineError, no process left."""
    monkeypatch.setattr(group, "usable_cpus", lambda: 8)
    with pytest.raises(EngineError) as e:
        LLM(tiny, tensor_parallel_size=3)
    assert str(e.value) == "tensor_parallel_size 3 does not divide the model's 4 attention heads"
    monkeypatch.setattr(group, "usable_cpus", lambda: 2)
    with pytest.raises(EngineError) as e:
        LLM(tiny, tensor_parallel_size=3)
    assert str(e.value) == "tensor_parallel_size 3 exceeds the 2 CPU cores this process may use (one rank per core " \
                           "at least)"
    with pytest.raises(EngineError, match=r"^tensor_parallel_size must be an integer >= 1, got 1.5$"):
        EngineConfig(model=tiny, tensor_parallel_size=1.5)
    with pytest.raises(EngineError, match=r"^tensor_parallel_size > 1 does not run dLLM-Serve's phases"):
        EngineConfig(model=str(SDAR), tensor_parallel_size=2, dllm_admission="phase")
    assert _ranks_left() == []


@needs_two_cores
def test_a_dead_rank_fails_the_request_with_one_line_and_leaves_nothing(tiny):
    """Protects failure handling: rank 1 SIGKILLed mid-generation makes the driver's next step raise
    TensorParallelError naming the rank and the signal; later calls raise the same line; no rank process remains."""
    if "qwen3" not in tiny:
        pytest.skip("one architecture is enough")
    eng = LLMEngine(EngineConfig(model=tiny, tensor_parallel_size=2))
    pid = eng.runner.group.pids[0]
    eng.add_request("r", _prompts(eng.model_config.vocab_size, (9,))[0], GREEDY)
    eng.step()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError) as e:
        for _ in range(10):
            eng.step()
    msg = str(e.value)
    assert msg.startswith(f"tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL") and "\n" not in msg
    with pytest.raises(TensorParallelError, match="rank 1"):
        eng.step()
    eng.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert _ranks_left() == []


@needs_two_cores
def test_ranks_exit_when_the_driver_is_killed(tiny, tmp_path):
    """Protects against orphans: a driver process SIGKILLed while it holds a tp=2 engine leaves no rank behind
    (each rank watches its driver)."""
    if "qwen3" not in tiny:
        pytest.skip("one architecture is enough")
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from tandem.engine.llm import LLM
        if __name__ == "__main__":
            llm = LLM({tiny!r}, tensor_parallel_size=2)
            print(*llm.engine.runner.group.pids, flush=True)
            time.sleep(60)
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 1 and psutil.pid_exists(pids[0])
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids)
