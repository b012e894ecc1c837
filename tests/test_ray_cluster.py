"""tandem on a real Ray cluster of two nodes on this machine (a head labelled tandem_p and a second `ray start`
labelled tandem_d, one CPU each; tandem.bench.ray_local, stopped by pid at the end):

- placement: `tandem serve --launcher ray` (a separate process, as a user runs it) places the prefill worker's
  actor on the tandem_p node and the decode worker's on the tandem_d node; 20 multi-round sessions replayed
  through HTTP all complete with the same tokens, round by round, as the embedded launcher's server gives them;
- failure: killing the decode worker's actor (ray.kill) mid-run ends every in-flight request with its output
  or a "worker lost" error, the supervisor starts a new actor on the same node, and /health is 200 again without
  a restart of `tandem serve`;
- sweeps: `tandem experiment --ray` writes a byte-identical results.json to the local run's, and `tandem
  plan --ray` picks the same deployments.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tandem[ray]'): the Ray launcher "
                                        "tests need it")
pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from tandem.bench.ray_local import LocalRayCluster  # noqa: E402
from tandem.bench.serve_client import scale_session  # noqa: E402
from tandem.cli.main import main  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402
from tandem.runtime.ray_launcher import connect  # noqa: E402
from tandem.workload.generators import generate  # noqa: E402

from live_server import LiveServer, free_port  # noqa: E402

MODEL = "tiny-ray"
NAMESPACE = "tandem-test-ray"
MAX_LEN, BLOCKS = 1024, 512
SESSIONS, RATE, SCALE, CAP, SEED = 20, 20.0, 0.1, 8, 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-ray")
    make_tiny_model(path, arch="qwen3", size="1m", seed=11)
    return str(path)


@pytest.fixture(scope="module")
def stack(ckpt):
    """(the two-node Ray cluster, a future of the embedded launcher's server on the same model): the embedded
    server starts while the Ray nodes do (both mostly wait), and is stopped by the first test once compared."""
    pool = ThreadPoolExecutor(1)
    embedded = pool.submit(LiveServer, ClusterConfig(ckpt, 1, 1, 0, "ampd", served_model_name=MODEL,
                                                     engine_args=dict(max_model_len=MAX_LEN, num_kv_blocks=BLOCKS)))
    try:
        with LocalRayCluster(["tandem_p", "tandem_d"], cpus=1) as rc, rc.driver():
            yield rc, embedded
            if ray.is_initialized():
                ray.shutdown()
    finally:
        if embedded.done() and embedded.exception() is None:
            embedded.result().stop()
        pool.shutdown()


@pytest.fixture(scope="module")
def cluster(stack) -> LocalRayCluster:
    return stack[0]


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def _wait(what: str, pred, timeout_s: float, every_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


async def _round(c: httpx.AsyncClient, prompt: list[int], max_tokens: int, session: str | None) -> dict:
    """One completion with token ids; status, tokens and the error message if any."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = await c.post("/v1/completions", json=body, headers={"x-session-id": session} if session else {})
    if r.status_code != 200:
        return {"status": r.status_code, "tokens": [], "error": r.json()["error"]["message"]}
    return {"status": 200, "tokens": r.json()["choices"][0]["token_ids"], "error": None}


def _replay(url: str, vocab: int) -> dict[tuple[str, int], list[int]]:
    """20 ToolBench-shaped sessions (x0.1, <= 8 output tokens a round, tool gaps <= 50 ms) at 20 sessions/s;
    every round's tokens."""
    sessions = [scale_session(s, SCALE, CAP) for s in generate("toolbench", SESSIONS, RATE, SEED)]
    out: dict[tuple[str, int], list[int]] = {}

    async def one(c: httpx.AsyncClient, s, t0: float) -> None:
        await asyncio.sleep(max(0.0, s.arrival_s - (time.monotonic() - t0)))
        rng, conv = random.Random(s.session_id), []
        for k, rnd in enumerate(s.rounds):
            conv = conv + [rng.randrange(3, vocab) for _ in range(rnd.input_tokens)]
            res = await _round(c, conv, rnd.output_tokens, s.session_id)
            assert res["status"] == 200, (s.session_id, k, res)
            out[s.session_id, k] = res["tokens"]
            conv = conv + res["tokens"]
            await asyncio.sleep(min(rnd.tool_s, 0.05))

    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            t0 = time.monotonic()
            await asyncio.gather(*(one(c, s, t0) for s in sessions))

    asyncio.run(go())
    assert len(out) == sum(len(s.rounds) for s in sessions) > SESSIONS   # multi-round; no session lost
    return out


def _node_of(name: str) -> dict:
    """The node (id and custom resources) the actor `name` of the server's namespace runs on."""
    where = ray.get(ray.get_actor(name, namespace=NAMESPACE).where.remote(), timeout=30)
    node = next(n for n in ray.nodes() if n["NodeID"] == where["node_id"])
    return {"node_id": where["node_id"], "labels": {k for k in node["Resources"] if k.startswith("tandem_")}}


def test_serve_on_two_ray_nodes_matches_embedded_and_survives_a_killed_decode_actor(stack, ckpt, tmp_path):
    """Protects placement and failure (see the module docstring): placement by --ray-place, the same tokens as the
    embedded launcher's for 20 multi-round sessions, and a killed decode actor going through the supervisor."""
    cluster, embedded = stack
    t_start = time.monotonic()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    srv = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", ckpt, "--port", str(port),
                            "--served-model-name", MODEL, "--max-model-len", str(MAX_LEN), "--num-kv-blocks",
                            str(BLOCKS), "--launcher", "ray", "--ray-address", cluster.address,
                            "--ray-place", "prefill=tandem_p", "--ray-place", "decode=tandem_d",
                            "--ray-namespace", NAMESPACE], stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, **cluster.env})
    try:
        embedded = embedded.result(timeout=180)
        _wait("tandem serve --launcher ray to be healthy", lambda: srv.poll() is None and _health(url) == 200
              or srv.poll() is not None, 120)
        assert srv.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        connect(cluster.address, namespace=NAMESPACE)
        prefill, decode = _node_of("worker-0.0"), _node_of("worker-1.0")
        assert prefill["labels"] == {"tandem_p"} and decode["labels"] == {"tandem_d"}
        assert prefill["node_id"] != decode["node_id"]

        print(f"servers up {time.monotonic() - t_start:.1f} s")
        vocab = min(embedded.cluster.tokenizer.vocab_size, 1000)
        on_ray = _replay(url, vocab)
        assert on_ray == _replay(embedded.url, vocab)                 # the same tokens, round by round
        print(f"replayed {time.monotonic() - t_start:.1f} s")
        embedded.stop()

        # 12 long generations in flight, then the decode worker's actor is killed
        async def burst() -> list[dict]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                reqs = [asyncio.create_task(_round(c, list(range(10 + i, 40 + i)), 400, None)) for i in range(12)]
                await asyncio.sleep(0.6)
                ray.kill(ray.get_actor("worker-1.0", namespace=NAMESPACE), no_restart=True)
                return await asyncio.gather(*reqs)

        t0 = time.monotonic()
        ended = asyncio.run(burst())
        for r in ended:                                               # output, or a clear error: nothing hangs
            assert (r["status"] == 200 and len(r["tokens"]) == 400) or (
                r["status"] >= 500 and "worker lost" in r["error"]), r
        assert any(r["status"] != 200 for r in ended), "the kill landed after every request had finished"
        _wait("/health 200 again", lambda: _health(url) == 200, 60)
        back_s = time.monotonic() - t0
        assert _node_of("worker-1.1") == {"node_id": decode["node_id"], "labels": {"tandem_d"}}   # a new actor
        res = asyncio.run(_once(url))
        assert res["status"] == 200 and len(res["tokens"]) == 8
        assert srv.poll() is None                                     # the same `tandem serve`, never restarted
        print(f"decode actor killed: /health 200 again after {back_s:.1f} s")
    finally:
        srv.terminate()
        rc = srv.wait(60)
        log.close()
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]


async def _once(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await _round(c, [5, 6, 7, 8, 9], 8, None)


def test_experiment_and_plan_on_ray_give_the_local_results(cluster, tmp_path, capsys):
    """Protects sweeps: the same sweep as Ray tasks on the two nodes writes a byte-identical results.json to
    the in-process run's (its wall times go to run.json), and the planner's answer is the same on Ray."""
    argv = ["experiment", "--preset", "demo", "--workloads", "toolbench", "--policies", "ampd,vllm", "--rates",
            "0.8,1.6", "--sessions", "6", "--no-progress"]
    assert main(argv + ["--jobs", "1", "--out", str(tmp_path / "local")]) == 0, capsys.readouterr().err
    assert main(argv + ["--ray", "--ray-address", cluster.address, "--out", str(tmp_path / "ray")]) == 0, \
        capsys.readouterr().err
    local, on_ray = (tmp_path / "local" / "results.json").read_bytes(), (tmp_path / "ray" / "results.json").read_bytes()
    assert local == on_ray
    assert json.loads((tmp_path / "ray" / "run.json").read_text())["executor"] == "RayExecutor"
    assert len(json.loads(local)["cells"]) == 4

    plan = ["plan", "--gpus", "8", "--workload", "toolbench", "--sessions", "20", "--no-cache", "--no-progress",
            "--format", "deploy", "--top", "2"]
    capsys.readouterr()
    assert main(plan + ["--jobs", "1"]) == 0
    want = capsys.readouterr().out
    assert main(plan + ["--ray", "--ray-address", cluster.address]) == 0
    assert capsys.readouterr().out == want and want.strip()
