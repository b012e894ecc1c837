"""`tandem bench` against a fake OpenAI-compatible streaming server (FastAPI + uvicorn in a thread).

The fake streams a role chunk at once, then `max_tokens` content chunks, the first after TTFT seconds
and the others ITL seconds apart, then a finish chunk, a usage chunk and [DONE]. It records every
request (headers, body, receive time, end of stream), so the tests check exactly what the client sent
and compare the client's measurements with the delays the fake applied.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import defaultdict

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402

from tandem.bench.serve_client import (BenchConfig, BenchError, base_url, parse_prometheus,  # noqa: E402
                                       run_bench, scale_session)
from tandem.bench.text import TextSynth  # noqa: E402
from tandem.cli.main import main  # noqa: E402
from tandem.workload.session import SLO, Round, Session, dump_sessions  # noqa: E402

TTFT = 0.06
ITL = 0.02
TOOL = 0.2


class Fake:
    """What the fake server does and what it saw."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests: list[dict] = []
        self.rounds: dict[str, int] = defaultdict(int)
        self.behavior: dict[str, tuple[str, int]] = {}   # session id -> (what, round)
        self.local = 0
        self.remote = 0
        self.prev_prompt: dict[str, int] = {}


FAKE = Fake()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    p = body["prompt"]
    return len(p) if isinstance(p, list) else len(p.split())


def make_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE tandem:local_prefills_total counter\n"
            f'tandem:local_prefills_total{{model_name="fake"}} {float(FAKE.local)}\n'
            "# TYPE tandem:remote_prefills_total counter\n"
            f'tandem:remote_prefills_total{{model_name="fake"}} {float(FAKE.remote)}\n')

    async def handle(request: Request, chat: bool):
        body = await request.json()
        sid = request.headers.get("x-session-id", "")
        k = FAKE.rounds[sid]
        FAKE.rounds[sid] += 1
        entry = {"path": request.url.path, "headers": dict(request.headers), "body": body,
                 "recv": time.perf_counter(), "sid": sid, "round": k, "end": None}
        FAKE.requests.append(entry)
        what = FAKE.behavior.get(sid)
        if what == ("http500", k):
            return JSONResponse({"error": {"message": "boom", "type": "InternalServerError"}}, status_code=500)
        if k == 0:
            FAKE.remote += 1
        else:
            FAKE.local += 1
        n = body["max_tokens"]
        prompt = _prompt_tokens(body)
        cached = FAKE.prev_prompt.get(sid, 0)
        FAKE.prev_prompt[sid] = prompt
        base = {"id": f"x-{sid}-{k}", "model": body["model"], "created": 0}

        async def gen():
            if chat:
                yield _sse({**base, "object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(TTFT)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL)
                if what == ("error_event", k) and i == 2:
                    yield _sse({"error": {"message": "worker died", "code": 500}})
                    return
                if what == ("cut", k) and i == 2:
                    return
                piece = f" r{k}t{i}"
                if chat:
                    yield _sse({**base, "object": "chat.completion.chunk",
                                "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
                else:
                    choice = {"index": 0, "text": piece, "finish_reason": None}
                    if body.get("return_token_ids"):
                        choice["token_ids"] = [300 + 10 * k + i]
                    yield _sse({**base, "object": "text_completion", "choices": [choice]})
            fin = {"index": 0, "finish_reason": "length"}
            fin.update({"delta": {}} if chat else {"text": ""})
            yield _sse({**base, "choices": [fin]})
            yield _sse({**base, "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}})
            entry["end"] = time.perf_counter()
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    return app


@pytest.fixture(scope="module")
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(), log_level="error", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(server):
    FAKE.reset()
    return FAKE


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _by_session(requests: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in requests:
        out[r["sid"]].append(r)
    return out


VLLM_FIELDS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p95_ttft_ms",
               "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
               "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"]
TANDEM_FIELDS = ["ttft_initial_p95_s", "ttft_incremental_p95_s", "slo_attainment", "round_slo_attainment",
                 "sessions_completed", "sessions_failed", "fail_reasons", "failures", "local_prefills",
                 "remote_prefills", "local_prefill_fraction", "client_start_lag_max_s"]


# --------------------------------------------------------------------------- chat replay


@pytest.mark.serial            # asserts the load generator starts each request within 50 ms: alone on the CPU
def test_chat_replay_order_headers_timing_and_metrics(server, fake):
    sessions = [
        Session("a", 0.0, [Round(7, 4, TOOL), Round(3, 5, TOOL), Round(2, 3)], slo=SLO(5.0, 1.0)),
        Session("b", 0.15, [Round(5, 3, TOOL), Round(4, 4)], slo=SLO(0.001, 1.0)),   # TTFT SLO unreachable
        Session("c", 0.3, [Round(6, 2)]),                                             # no SLO
    ]
    res = asyncio.run(run_bench(sessions, BenchConfig(url=server + "/v1/")))
    assert res.model == "fake-model"
    by = _by_session(fake.requests)
    assert sorted(by) == ["a", "b", "c"]
    for s in sessions:
        reqs = by[s.session_id]
        assert [r["round"] for r in reqs] == list(range(len(s.rounds)))       # rounds in order, each once
        for k, (r, rnd) in enumerate(zip(reqs, s.rounds)):
            assert r["path"] == "/v1/chat/completions"
            assert r["headers"]["x-session-id"] == s.session_id
            b = r["body"]
            assert b["model"] == "fake-model" and b["max_tokens"] == rnd.output_tokens
            assert b["ignore_eos"] is True and b["temperature"] == 0 and b["stream"] is True
            assert b["stream_options"] == {"include_usage": True}
            msgs = b["messages"]
            assert len(msgs) == 1 + 2 * k
            assert len(msgs[-1]["content"].split()) == rnd.input_tokens       # one filler word per token
            if k == 0:
                assert msgs[0]["role"] == "user"
                continue
            prev = reqs[k - 1]
            assert msgs[:-2] == prev["body"]["messages"]                       # history kept verbatim
            reply = "".join(f" r{k - 1}t{i}" for i in range(s.rounds[k - 1].output_tokens))
            assert msgs[-2] == {"role": "assistant", "content": reply}         # the previous reply appended
            assert msgs[-1]["role"] == "tool" and msgs[-1]["tool_call_id"]
            gap = r["recv"] - prev["end"]                                      # the tool gap, server side
            assert TOOL - 0.01 <= gap <= TOOL + 0.4, gap        # upper bound: event-loop delay on a loaded machine

    # arrivals respected, and client-side tool gaps
    ms = {(m.session_id, m.index): m for m in res.rounds}
    assert ms[("b", 0)].sent_s >= 0.15 and ms[("c", 0)].sent_s >= 0.3
    for s in sessions:
        for k in range(1, len(s.rounds)):
            prev, cur = ms[(s.session_id, k - 1)], ms[(s.session_id, k)]
            assert cur.sent_s - (prev.sent_s + prev.e2e_s) >= TOOL - 0.005

    # measured latencies match the fake's delays (the role-only chunk is not a token)
    for m in res.rounds:
        assert m.ok and m.error == ""
        assert TTFT - 0.005 <= m.ttft_s <= TTFT + 0.25, m.ttft_s
        assert len(m.itls_s) == m.max_tokens - 1 == m.token_chunks - 1
        mean_itl = sum(m.itls_s) / len(m.itls_s)
        assert ITL - 0.005 <= mean_itl <= ITL + 0.08, m.itls_s
        assert m.output_tokens == m.max_tokens and m.finish_reason == "length"
        assert m.cached_tokens == (0 if m.index == 0 else ms[(m.session_id, m.index - 1)].prompt_tokens)

    out = res.metrics()
    for key in VLLM_FIELDS + TANDEM_FIELDS:
        assert key in out, key
    json.dumps(out)
    assert out["completed"] == 6 and out["failed"] == 0 and out["rounds_not_run"] == 0
    assert out["sessions_completed"] == 3 and out["sessions_failed"] == 0
    assert out["total_output_tokens"] == sum(r.output_tokens for s in sessions for r in s.rounds)
    assert out["total_new_input_tokens"] == sum(r.input_tokens for s in sessions for r in s.rounds)
    assert out["slo_attainment"] == 0.5                  # a attains, b misses, c has no SLO
    assert out["round_slo_attainment"] == 3 / 5
    assert TTFT * 1000 - 5 <= out["mean_ttft_ms"] <= (TTFT + 0.08) * 1000
    assert ITL * 1000 - 5 <= out["median_itl_ms"] <= (ITL + 0.03) * 1000
    assert 0 <= out["client_start_lag_max_s"] < 0.05
    assert out["ttft_initial_p95_s"] is not None and out["ttft_incremental_p95_s"] is not None
    assert out["local_prefills"] == 3 and out["remote_prefills"] == 3 and out["local_prefill_fraction"] == 0.5
    # the records are the simulator's, filled with the same measurements
    rec_a = next(r for r in res.records if r.session_id == "a")
    assert rec_a.completed and len(rec_a.rounds) == 3
    assert abs(rec_a.rounds[1].ttft_s - ms[("a", 1)].ttft_s) < 1e-9
    assert rec_a.rounds[1].itl_count == 4


def test_user_role_for_new_tokens(server, fake):
    sessions = [Session("u", 0.0, [Round(3, 2, 0.0), Round(2, 2)])]
    res = asyncio.run(run_bench(sessions, BenchConfig(url=server, tool_role="user", scrape_metrics=False)))
    assert res.metrics()["completed"] == 2
    msgs = fake.requests[1]["body"]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]


# --------------------------------------------------------------------------- failures


def test_failures_counted_with_reasons(server, fake):
    fake.behavior.update({"f500": ("http500", 1), "ferr": ("error_event", 0), "fcut": ("cut", 0)})
    sessions = [Session(sid, 0.0, [Round(3, 4, 0.05), Round(3, 4, 0.05), Round(2, 2)], slo=SLO(10.0, 10.0))
                for sid in ("ok", "f500", "ferr", "fcut")]
    res = asyncio.run(run_bench(sessions, BenchConfig(url=server)))
    out = res.metrics()
    assert out["sessions_completed"] == 1 and out["sessions_failed"] == 3
    assert out["fail_reasons"] == {"http 500": 1, "incomplete stream": 1, "stream error": 1}
    reasons = {f["session_id"]: (f["round"], f["reason"]) for f in out["failures"]}
    assert reasons["f500"] == (1, "http 500: boom")
    assert reasons["ferr"] == (0, "stream error: worker died")
    assert reasons["fcut"][0] == 0 and reasons["fcut"][1].startswith("incomplete stream")
    assert out["failed"] == 3 and out["completed"] == 3 + 1     # ok's 3 rounds + f500's round 0
    assert out["rounds_not_run"] == 1 + 2 + 2                   # nothing after a failed round
    assert out["slo_attainment"] == 0.25                        # failed sessions are misses
    recs = {r.session_id: r for r in res.records}
    assert recs["f500"].failed and recs["f500"].fail_reason == "http 500: boom"
    assert len(fake.requests) == 3 + 2 + 1 + 1


def test_connection_refused_raises(server):
    with pytest.raises(BenchError, match="cannot connect"):
        asyncio.run(run_bench([Session("x", 0.0, [Round(1, 1)])],
                              BenchConfig(url=f"http://127.0.0.1:{_closed_port()}")))


# --------------------------------------------------------------------------- completions, exact lengths


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tandem.engine.tiny_model import build_tokenizer
    from tandem.engine.tokenizer import Tokenizer
    return Tokenizer(build_tokenizer())


@pytest.mark.parametrize("server_ids", [True, False])
def test_completions_token_id_prompts(server, fake, tiny_tokenizer, server_ids):
    sessions = [Session("p", 0.0, [Round(11, 3, 0.0), Round(5, 4, 0.0), Round(7, 2)])]
    cfg = BenchConfig(url=server, endpoint="completions", model="m", tokenizer=tiny_tokenizer,
                      return_token_ids=server_ids, scrape_metrics=False)
    res = asyncio.run(run_bench(sessions, cfg))
    assert res.metrics()["completed"] == 3
    reqs = fake.requests
    assert [r["path"] for r in reqs] == ["/v1/completions"] * 3
    assert all(r["body"].get("return_token_ids", False) is server_ids for r in reqs)
    p0, p1, p2 = (r["body"]["prompt"] for r in reqs)
    assert len(p0) == 11 and all(isinstance(i, int) for i in p0)
    for k, (prev, cur) in enumerate([(p0, p1), (p1, p2)]):
        n_out = sessions[0].rounds[k].output_tokens
        if server_ids:
            reply = [300 + 10 * k + i for i in range(n_out)]
        else:
            reply = tiny_tokenizer.encode("".join(f" r{k}t{i}" for i in range(n_out)), add_special_tokens=False)
        assert cur[: len(prev)] == prev
        assert cur[len(prev): len(prev) + len(reply)] == reply
        assert len(cur) == len(prev) + len(reply) + sessions[0].rounds[k + 1].input_tokens
    assert [m.prompt_tokens_sent for m in res.rounds] == [len(p0), len(p1), len(p2)]
    assert res.metrics()["history_sources"] == {"server" if server_ids else "reencoded": 2}


def test_chat_exact_content_lengths(server, fake, tiny_tokenizer):
    sessions = [Session("e", 0.0, [Round(13, 2, 0.0), Round(9, 2)])]
    asyncio.run(run_bench(sessions, BenchConfig(url=server, tokenizer=tiny_tokenizer, scrape_metrics=False)))
    msgs = fake.requests[1]["body"]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    count = [len(tiny_tokenizer.encode(m["content"], add_special_tokens=False)) for m in msgs]
    assert count[0] == 13 and count[2] == 9


def test_completions_text_without_tokenizer(server, fake):
    sessions = [Session("t", 0.0, [Round(6, 3, 0.0), Round(4, 2)])]
    asyncio.run(run_bench(sessions, BenchConfig(url=server, endpoint="completions", scrape_metrics=False)))
    p0, p1 = (r["body"]["prompt"] for r in fake.requests)
    assert isinstance(p0, str) and len(p0.split()) == 6
    reply = " r0t0 r0t1 r0t2"
    assert p1.startswith(p0 + reply) and len(p1[len(p0 + reply):].split()) == 4


def test_text_exact_token_counts(tiny_tokenizer):
    synth = TextSynth(tiny_tokenizer, seed=3)
    assert synth.pool_exact and synth.mode == "exact"
    for n in (1, 2, 7, 64, 999):
        text = synth.text(n, "s", n)
        assert len(tiny_tokenizer.encode(text, add_special_tokens=False)) == n
        assert text == TextSynth(tiny_tokenizer, seed=3).text(n, "s", n)       # deterministic
    assert synth.text(50, "s", 0) != synth.text(50, "other", 0)                 # sessions share no prefix
    assert synth.inexact == 0
    words = TextSynth(None, seed=0)
    assert len(words.text(40, "s", 0).split()) == 40 and words.text(0, "s", 1) == ""


def test_scale_and_cap():
    s = Session("x", 1.0, [Round(1000, 200, 4.0), Round(0, 10, 2.0), Round(3, 1)])
    t = scale_session(s, 0.05, cap=8)
    assert [(r.input_tokens, r.output_tokens, r.tool_s) for r in t.rounds] == [(50, 8, 0.2), (0, 1, 0.1), (1, 1, 0.0)]
    assert t.arrival_s == 1.0 and s.rounds[0].input_tokens == 1000                 # arrivals kept, input untouched


def test_helpers():
    assert base_url("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    page = ('# HELP x\ntandem:local_prefills_total{a="1"} 2.0\ntandem:local_prefills_total{a="2"} 3\n'
            'tandem:local_prefills_created 9\n')
    assert parse_prometheus(page) == {"tandem:local_prefills_total": 5.0, "tandem:remote_prefills_total": None}


# --------------------------------------------------------------------------- CLI


def test_cli_connection_refused_one_line(capsys):
    rc = main(["bench", "--url", f"http://127.0.0.1:{_closed_port()}", "--workload", "toolbench",
               "--rate", "1", "--sessions", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("tandem: error: cannot connect to http://127.0.0.1:") and err.count("\n") == 1, err


def test_cli_json_and_table(server, fake, tmp_path, capsys):
    trace = tmp_path / "w.jsonl"
    dump_sessions([Session("cli-0", 0.0, [Round(40, 60, 2.0), Round(20, 40)], slo=SLO(2.0, 0.5))], trace)
    out_file = tmp_path / "r.json"
    rec_file = tmp_path / "records.jsonl"
    rc = main(["bench", "--url", server, "--workload", str(trace), "--scale", "0.1", "--max-tokens-cap", "5",
               "--json", "--out", str(out_file), "--records", str(rec_file), "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = json.loads(cap.out)
    assert out == json.loads(out_file.read_text())
    (rec,) = [json.loads(x) for x in rec_file.read_text().splitlines()]
    assert rec["session_id"] == "cli-0" and rec["completed"] and len(rec["rounds"]) == 2
    assert [r["output_tokens"] for r in rec["rounds"]] == [5, 4] and all(r["ttft_s"] > 0 for r in rec["rounds"])
    for key in VLLM_FIELDS + TANDEM_FIELDS:
        assert key in out, key
    assert out["workload"] == str(trace) and out["scale"] == 0.1 and out["slo_attainment"] == 1.0
    assert [r["body"]["max_tokens"] for r in fake.requests] == [5, 4]               # 60*0.1 capped, 40*0.1
    assert fake.requests[1]["recv"] - fake.requests[0]["end"] >= 0.2 - 0.01         # tool gap 2.0 * 0.1

    fake.reset()
    fake.behavior["cli-0"] = ("http500", 0)
    rc = main(["bench", "--url", server, "--workload", str(trace), "--no-progress", "--max-tokens-cap", "2"])
    cap = capsys.readouterr()
    assert rc == 1
    assert "SLO attainment" in cap.out and "failed x1: http 500" in cap.out
    assert "every session failed" in cap.err
