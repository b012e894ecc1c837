"""Hostile JSON bodies at a live `tandem serve`: a key flood under the byte cap, a boolean token id, an id past the
vocabulary.

* Key flood: four 7.6 MB bodies whose logit_bias has 700k keys, sent at once while /health is polled from another
  thread. Each must be a 400 naming logit_bias within 1 s, and /health's p99 must stay under 100 ms (the bodies
  once took 5 s each to parse, one after another, and stalled /health 1.65 s).
* Token ids: `[true]` as a prompt must be a 400 naming prompt (it was taken as id 1); the first id past the bound
  (the model's vocabulary, tandem.server.vocab) must be a 400 in a prompt and in /detokenize alike, and the last id
  inside it must be served by both.

Everything goes to 127.0.0.1; counts and times are bounded."""
from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tandem.bench.chaos import ChaosContext, Outcome
from tandem.bench.serve_process import serve_subprocess

FLOOD_KEYS = 700_000           # the finding's body: 7.6 MB of logit_bias keys
FLOOD_BODIES = 4               # sent at once
ANSWER_WITHIN_S = 1.0          # each must be answered (a 400) within this
HEALTH_P99_S = 0.100           # /health's p99 while they are handled
HEALTH_EVERY_S = 0.010         # /health is asked this often
HEALTH_AFTER_S = 0.5           # ... and for this long after the last answer (the server may still be busy)


def flood_body(keys: int = FLOOD_KEYS) -> bytes:
    """A completion request whose logit_bias has `keys` keys, compact (about 7.6 MB for 700k)."""
    bias = ",".join(f'"{i}":1' for i in range(keys))
    return b'{"prompt":"hi","max_tokens":1,"logit_bias":{' + bias.encode() + b"}}"


def _serve_args(model: Path) -> list[str]:
    return ["--model", str(model), "--prefill-workers", "1", "--decode-workers", "1"]


def _poll_health(url: str, stop: threading.Event, out: list[float]) -> None:
    """GET /health every HEALTH_EVERY_S until `stop`, appending each latency (a failure counts as 10 s)."""
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append(time.perf_counter() - t0 if ok else 10.0)
            stop.wait(HEALTH_EVERY_S)


def _post(url: str, path: str, body: bytes) -> tuple[int, str | None, float]:
    """(status, the error's param, seconds to the answer) of one POST."""
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(path, content=body, headers={"content-type": "application/json"})
    took = time.perf_counter() - t0
    try:
        param = r.json().get("error", {}).get("param") if r.status_code >= 400 else None
    except ValueError:
        param = "<not JSON>"
    return r.status_code, param, took


def key_flood(url: str, bodies: int = FLOOD_BODIES, keys: int = FLOOD_KEYS) -> tuple[list[tuple[int, str | None,
                                                                                                   float]],
                                                                                      list[float]]:
    """Send `bodies` key-flood bodies at once while polling /health: (their answers, /health latencies)."""
    body = flood_body(keys)
    lat: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll_health, args=(url, stop, lat), daemon=True)
    poller.start()
    time.sleep(0.2)                                            # a few /health answers before the flood
    with ThreadPoolExecutor(bodies) as pool:
        answers = list(pool.map(lambda _: _post(url, "/v1/completions", body), range(bodies)))
    time.sleep(HEALTH_AFTER_S)
    stop.set()
    poller.join(15)
    return answers, lat


def p99(values: list[float]) -> float:
    """The 99th percentile (the largest value with fewer than 100 samples)."""
    return statistics.quantiles(values, n=100)[98] if len(values) >= 100 else max(values)


def probe_key_flood(ctx: ChaosContext) -> list[Outcome]:
    """Four 700k-key logit_bias bodies at once against 1P+1D (see the module doc)."""
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    with serve_subprocess(_serve_args(ctx.ar_model), ctx.workdir / "http_body_flood_serve.log") as (url, _):
        answers, lat = key_flood(url)
    size = len(flood_body()) / 1e6
    worst = max(took for *_, took in answers)
    ok = all(status == 400 and param == "logit_bias" and took < ANSWER_WITHIN_S for status, param, took in answers)
    seen = ", ".join(f"{s} {p} in {t * 1e3:.0f} ms" for s, p, t in answers)
    h99 = p99(lat)
    return [Outcome(f"{FLOOD_BODIES} bodies of {size:.1f} MB, logit_bias with {FLOOD_KEYS} keys, at once",
                    f"each a 400 naming logit_bias within {ANSWER_WITHIN_S:g} s", f"{seen} (slowest {worst:.2f} s)",
                    ok),
            Outcome(f"/health every {HEALTH_EVERY_S * 1e3:g} ms meanwhile", f"p99 < {HEALTH_P99_S * 1e3:g} ms",
                    f"p99 {h99 * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms over {len(lat)} answers",
                    h99 < HEALTH_P99_S)]


def vocabulary_bound(model: Path) -> int:
    """The token-id bound the server applies: the model's vocabulary (tandem.server.vocab)."""
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def probe_token_ids(ctx: ChaosContext) -> list[Outcome]:
    """A boolean token id and the vocabulary bound on prompts and /detokenize (see the module doc)."""
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    bound = vocabulary_bound(ctx.ar_model)
    cases = [("prompt [true]", "/v1/completions", {"prompt": [True], "max_tokens": 1}, (400, "prompt")),
             (f"prompt [{bound}] (first id past the bound)", "/v1/completions", {"prompt": [bound], "max_tokens": 1},
              (400, "prompt")),
             (f"/detokenize [{bound}]", "/detokenize", {"tokens": [bound]}, (400, "tokens")),
             (f"prompt [{bound - 1}] (last id inside)", "/v1/completions", {"prompt": [bound - 1], "max_tokens": 1},
              (200, None)),
             (f"/detokenize [{bound - 1}]", "/detokenize", {"tokens": [bound - 1]}, (200, None))]
    out = []
    with serve_subprocess(_serve_args(ctx.ar_model), ctx.workdir / "http_body_ids_serve.log") as (url, _):
        for attack, path, body, want in cases:
            status, param, _ = _post(url, path, json.dumps(body).encode())
            expected = f"{want[0]} naming {want[1]}" if want[1] else str(want[0])
            out.append(Outcome(attack, expected, f"{status} naming {param}" if param else str(status),
                               (status, param) == want))
    return out


PROBES = [probe_key_flood, probe_token_ids]
