"""Completions `echo` (the prompt's text, and with logprobs its tokens' logprobs, before the completion) and
`logit_bias` (chat and completions) through HTTP on a tiny checkpoint, as vLLM's OpenAI server does; and both
across the multi-process runtime (the wire format keeps int token ids; prompt logprobs come back from the worker)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.engine.tokenizer import Tokenizer  # noqa: E402
from tandem.runtime import messages as m  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.runtime.coordinator_shell import params_dict  # noqa: E402
from tandem.runtime.transport import Codec  # noqa: E402
from tandem.server.app import build_app  # noqa: E402

from live_server import uvicorn_app  # noqa: E402

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE_ARGS = dict(num_kv_blocks=256, max_model_len=256)
PROMPT = "Hello world, hello"
IDS = [72, 101, 108, 108, 111, 278, 111, 114]
FORCED = 321                                   # decodes to " res"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-echo")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    return str(path)


@pytest.fixture(scope="module")
def client(ckpt) -> Iterator[AsyncLLM]:
    c = AsyncLLM.from_model(ckpt, served_model_name="tiny", **ENGINE_ARGS)
    yield c
    asyncio.run(c.shutdown())


@pytest.fixture(scope="module")
def url(client) -> Iterator[str]:
    """The app on uvicorn, 127.0.0.1 and a free port, in a daemon thread."""
    with uvicorn_app(build_app(client, api_key=KEY)) as port:
        yield f"http://127.0.0.1:{port}"


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body), headers=AUTH, timeout=60)


def _complete(url: str, **body) -> dict:
    r = _post(url, "/v1/completions", {"max_tokens": 5, "temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, **body) -> list[dict]:
    """The JSON chunks of a streamed completion (the [DONE] event checked and dropped)."""
    r = _post(url, "/v1/completions", {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
                                       **body})
    assert r.status_code == 200, r.text
    blocks = [b[len("data: "):] for b in r.text.strip().split("\n\n")]
    assert blocks[-1] == "[DONE]"
    return [json.loads(b) for b in blocks[:-1]]


# ---------------------------------------------------------------------------- echo
@pytest.mark.parametrize("prompt,shown", [(PROMPT, PROMPT), (IDS, "Hello wor")])
def test_echo_puts_the_prompt_text_before_the_completion(url, prompt, shown):
    """Protects echo without logprobs: the text prompt as sent (a token-id prompt decoded) then the completion;
    streaming sends the same text, the prompt in the first chunk; usage counts the prompt once."""
    plain = _complete(url, prompt=prompt)
    echoed = _complete(url, prompt=prompt, echo=True)
    completion = plain["choices"][0]["text"]
    assert echoed["choices"][0]["text"] == shown + completion
    assert echoed["usage"] == plain["usage"]
    chunks = _stream(url, prompt=prompt, echo=True)
    assert chunks[0]["choices"][0]["text"].startswith(shown)
    assert "".join(c["choices"][0]["text"] for c in chunks) == shown + completion


def test_echo_with_logprobs_leads_with_the_prompts_tokens(url, ckpt):
    """Protects echo + logprobs (vLLM's shape): one entry per prompt token first (the first one's logprob and top
    logprobs None; the others the engine's prompt logprobs, k + 1 at most), then the completion's, unchanged;
    return_token_ids still gives the completion's and the prompt's ids apart."""
    plain = _complete(url, prompt=IDS, logprobs=2, return_token_ids=True)["choices"][0]
    body = _complete(url, prompt=IDS, logprobs=2, echo=True, return_token_ids=True)
    choice, n = body["choices"][0], len(IDS)
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == n + 5 and "".join(lp["tokens"][:n]) == "Hello wor"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    specials = Tokenizer.from_pretrained(ckpt).special_token_ids      # skipped from text: they do not advance it
    shown = [0 if i >= n and t in specials else len(s) for i, (t, s) in enumerate(zip(IDS + choice["token_ids"],
                                                                                       lp["tokens"]))]
    assert lp["text_offset"] == [sum(shown[:i]) for i in range(n + 5)]
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    ref = LLM(ckpt, **ENGINE_ARGS).generate([IDS], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert lp["token_logprobs"][1:n] == pytest.approx([ref.prompt_logprobs[j][IDS[j]] for j in range(1, n)], abs=1e-5)
    assert choice["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 5
    assert choice["prompt_token_ids"] == IDS and body["usage"]["prompt_tokens"] == n

    chunks = _stream(url, prompt=IDS, logprobs=2, echo=True)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert streamed[0]["token_logprobs"][0] is None and len(streamed[0]["tokens"]) >= n
    assert sum((s["token_logprobs"] for s in streamed), []) == lp["token_logprobs"]


# ---------------------------------------------------------------------------- logit_bias
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("bias,says", [({"abc": 5}, "must be token ids"), ({"448": 5}, "outside the vocabulary"),
                                       ({"-1": 5}, "outside the vocabulary"), ({"5": 101}, "must be in [-100, 100]"),
                                       ({"5": -100.5}, "must be in [-100, 100]")])
def test_a_bad_logit_bias_is_a_400_naming_it(url, path, bias, says):
    """Protects the 400s (OpenAI's): a key that is not an integer, an id outside [0, vocab 448), |bias| > 100."""
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = _post(url, path, {**body, "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["code"] == "invalid_value" and says in err["message"]


def test_a_plus_100_bias_forces_the_token_through_http(url, client):
    """Protects logit_bias from the API to the sampler: greedy and sampled completions and a chat answer are the
    forced token only."""
    for temperature in (0, 1.0):
        body = _complete(url, prompt=PROMPT, temperature=temperature, return_token_ids=True,
                         logit_bias={str(FORCED): 100})
        assert body["choices"][0]["token_ids"] == [FORCED] * 5
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                            "temperature": 0, "logit_bias": {str(FORCED): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " res res res"


# ---------------------------------------------------------------------------- multi-process runtime
def test_logit_bias_and_prompt_logprobs_survive_the_wire_with_int_keys():
    """Protects the runtime's msgpack messages: AddRequest's params keep logit_bias's int ids (SamplingParams is
    rebuilt equal), a Delta keeps prompt logprobs (None first, int token ids)."""
    codec = Codec([*m.CONTROL, *m.UPSTREAM, *m.KV])
    params = SamplingParams(temperature=0, logit_bias={5: 100.0, 7: -2.5}, prompt_logprobs=3, logprobs=1)
    msg = codec.decode(codec.encode(m.AddRequest("r", "s", [1, 2, 3], params_dict(params))))
    assert msg.params["logit_bias"] == {5: 100.0, 7: -2.5} and SamplingParams(**msg.params) == params
    plp = [None, {2: -1.5, 9: -0.5}, {3: -0.25}]
    delta = codec.decode(codec.encode(m.Outputs([m.Delta("r", [4], "x", prompt_logprobs=plp)]))).deltas[0]
    assert delta.prompt_logprobs == plp


def test_the_cluster_prefills_a_prompt_logprobs_round_at_home_and_returns_them(ckpt):
    """Protects the multi-process path: under dynamo (always remote), a round with prompt_logprobs is prefilled on
    its decode worker (one local prefill, no KV transfer) and its prompt logprobs and logit-biased tokens equal the
    offline engine's."""
    from tandem.runtime.cluster import ClusterConfig, ServingCluster
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1,
                            logit_bias={FORCED: 5.0})

    async def main():
        c = await ServingCluster.start(ClusterConfig(ckpt, 1, 1, 0, "dynamo", engine_args=ENGINE_ARGS))
        try:
            last = None
            async for o in c.generate(IDS * 3, params, "plp"):
                last = o
            return last, c.stats()
        finally:
            await c.shutdown()

    out, stats = asyncio.run(main())
    ref = LLM(ckpt, **ENGINE_ARGS).generate([IDS * 3], params)[0]
    assert out.error is None and out.outputs[0].token_ids == ref.token_ids
    assert out.prompt_logprobs is not None, \
        "no prompt logprobs from the worker: WorkerShell._delta must put RequestOutput.prompt_logprobs in its first Delta"
    assert len(out.prompt_logprobs) == len(IDS) * 3 and out.prompt_logprobs[0] is None
    for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    assert stats.local_prefills == 1 and stats.remote_prefills == 0 and not stats.kv_transfer_seconds
