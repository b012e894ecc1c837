"""`tandem serve` with dLLM-Serve's Refresh/Reuse phases.

One co-located worker process serves the trained tiny SDAR model with phase-multiplexed admission over sparse KV
(ρ = 0.5) and a logit cap, its KV pool sized from a CPU memory budget: completions come back, /metrics shows the
phase mix (sequence-steps and query tokens by phase, steps), admissions by what ran beside them, the activation
budget and the KV pool. The CLI refuses bad dLLM-Serve options with one line.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tandem.cli.main import main  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402
from live_server import LiveServer  # noqa: E402
from test_server_diffusion import ASSET  # noqa: E402 - the trained tiny SDAR checkpoint

KEY = "sk-dllm-serve"


@pytest.fixture(scope="module")
def server():
    args = {"max_model_len": 256, "max_num_batched_tokens": 256, "max_num_logits": 32,
            "cpu_memory_budget_bytes": 256 << 20, "dllm_admission": "phase", "kv_retention_ratio": 0.5,
            "dllm_unmasking_strategy": "low_confidence_static"}
    srv = LiveServer(ClusterConfig(str(ASSET), 0, 0, 1, "vllm", served_model_name="sdar", engine_args=args),
                     api_key=KEY)
    yield srv
    srv.stop()


def _metric(text: str, name: str, **labels) -> float:
    """The value of one sample of /metrics."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model_name": "sdar"}.items()))
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    assert m is not None, f"{name}{{{want}}} not in /metrics"
    return float(m.group(1))


def test_requests_run_in_phases_and_metrics_show_the_mix_admissions_and_memory(server):
    """Four requests of 40 tokens (one a step, two blocks each: the prompt's block, then a whole one; each block one
    full step, one Refresh, the rest Reuse): 160 sequence-steps, full = refresh = 8, reuse = 144; four admissions;
    the activation budget and the KV pool come from the memory profile."""
    def complete(i: int) -> dict:
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": "sdar", "prompt": f"copy: abc{'d' * i} ->", "max_tokens": 40,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(complete, range(4)))
    assert [o["usage"]["completion_tokens"] for o in outs] == [40] * 4
    def scrape() -> tuple[str, dict]:
        m = httpx.get(server.url + "/metrics", timeout=30).text
        return m, {p: _metric(m, "tandem:dllm_phase_seq_steps_total", phase=p) for p in ("full", "refresh", "reuse")}
    # the worker publishes its step counts beside its next steps (at most every 20 ms), so the last steps' counts
    # may reach /metrics just after the responses: wait until all 160 sequence-steps are in, then check them
    server.wait_for("the last step counts", lambda: sum(scrape()[1].values()) >= 160, 10.0, 0.05)
    m, steps = scrape()
    assert steps == {"full": 8.0, "refresh": 8.0, "reuse": 144.0}
    assert _metric(m, "tandem:dllm_admissions_total", into="running") + \
        _metric(m, "tandem:dllm_admissions_total", into="idle") == 4.0
    assert _metric(m, "tandem:dllm_phase_tokens_total", phase="reuse") == 144.0 * 32
    assert _metric(m, "tandem:dllm_steps_total") > 0 and _metric(m, "tandem:dllm_phase_mix", phase="reuse") > 0
    assert _metric(m, "tandem:activation_budget_bytes") > 0 and _metric(m, "tandem:kv_cache_pool_bytes") > 0
    assert _metric(m, "tandem:activation_peak_bytes", logits="decomposed") < \
        _metric(m, "tandem:activation_peak_bytes", logits="monolithic")


def test_the_cli_refuses_bad_dllm_serve_options_with_one_line(tmp_path, capsys):
    """A sparse-KV knob needs --dllm-admission; the pooling kernel is odd; dLLM-Serve needs a diffusion model."""
    ar = make_tiny_model(tmp_path / "ar", seed=1)
    cases = (([str(ASSET), "--colocated", "1", "--kv-retention-ratio", "0.5"],
              "--kv-retention-ratio needs --dllm-admission"),
             ([str(ASSET), "--colocated", "1", "--dllm-admission", "phase", "--kv-pool-kernel", "4"],
              "--kv-pool-kernel must be odd"),
             ([str(ar), "--colocated", "1", "--dllm-admission", "phase"],
              "--dllm-admission: the model is autoregressive"),
             ([str(ASSET), "--colocated", "1", "--dllm-admission", "phase", "--kv-retention-ratio", "0"],
              "must be in (0, 1]"))
    for args, expect in cases:
        assert main(["serve", "--model", *args, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1, err
