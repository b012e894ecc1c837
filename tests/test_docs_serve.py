"""The docs' `tandem serve` commands run as written, and the diffusion one decodes greedy requests reproducibly.

Every command line in a code block of docs/*.md that starts with `tandem serve` (after any `VAR=value`, with `\\`
continuations joined, `[optional]` parts and `# comments` dropped) is parsed by the CLI's own parser and built into
its deployment by the code `tandem serve` runs (the cluster configuration, then the worker specs, where a policy that
does not fit the workers is refused). Models named there that are not in the repository become the tiny model the
tests make; options naming files that other documented commands write (`--perf`, `--dllm-latency-profile`,
`--api-key-file`) are left out (their checks: tests/test_profile_dllm.py, tests/test_profiler.py). Two run live on
127.0.0.1: the co-located AR command of docs/server.md (/health and one completion), and docs/diffusion.md's command
on the committed tiny SDAR, where the same greedy prompt, sent 10 times (streamed and not) while sampled requests
keep the server busy, decodes the same tokens every time: SDAR's reference loop's.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tandem.bench.chaos.diffusion import DOC_ARGS, GREEDY_PROMPT, MAX_TOKENS, greedy_under_load, serve  # noqa: E402
from tandem.cli import serve_cmd  # noqa: E402
from tandem.cli.main import build_parser  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ServingCluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SDAR = ROOT / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
FILE_OPTIONS = ("--perf", "--dllm-latency-profile", "--api-key-file")   # files other documented commands write
LIVE_AR = ["--colocated", "2", "--policy", "vllm"]                      # docs/server.md's co-located command


def documented_serve_commands() -> list[tuple[str, list[str]]]:
    """(where, the arguments after `tandem serve`) of every command line in a code block of docs/*.md."""
    found = []
    for md in sorted((ROOT / "docs").glob("*.md")):
        lines = md.read_text().splitlines()
        fenced, i = False, 0
        while i < len(lines):
            line, start = lines[i], i
            i += 1
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not (fenced or line.startswith("    ")):
                continue
            text = line.strip()
            while text.endswith("\\") and i < len(lines):
                text, i = text[:-1] + " " + lines[i].strip(), i + 1
            text = re.sub(r"\[[^\]]*\]", " ", text)                      # [optional parts]
            try:
                tokens = shlex.split(text, comments=True)
            except ValueError:
                continue
            while tokens and ENV.fullmatch(tokens[0]):
                tokens.pop(0)
            if tokens[:2] == ["tandem", "serve"]:
                found.append((f"{md.name}:{start + 1}", tokens[2:]))
    return found


@pytest.fixture(scope="module")
def tiny_ar(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    make_tiny_model(str(path), arch="qwen3", size="1m", seed=0)
    return path


def runnable(args: list[str], tiny_ar: Path) -> list[str]:
    """A documented command's arguments made runnable here: its model (the repository's, else the tiny AR one), no
    file options, no host or port (the runner picks 127.0.0.1 and a free port)."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in FILE_OPTIONS or a in ("--host", "--port"):
            i += 2
            continue
        if a == "--model":
            model = ROOT / args[i + 1]
            out += ["--model", str(model if (model / "config.json").is_file() else tiny_ar)]
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def test_the_docs_show_serve_commands_for_each_kind_of_deployment():
    """Protects the extraction itself (a docs change that hid every command would make the next test vacuous): the
    docs show the P/D command, the co-located one, the Ray one and the diffusion one, this page's exactly as the
    chaos probe and the live test below run it."""
    found = documented_serve_commands()
    where = {w.split(":")[0] for w, _ in found}
    assert {"server.md", "ray.md", "diffusion.md", "profiler.md"} <= where
    assert LIVE_AR == [a for a in next(args for w, args in found if "--colocated" in args and "--policy" in args)
                       if a not in ("--model", "models/tiny")]
    diffusion = [args for w, args in found if w.startswith("diffusion.md")]
    assert diffusion == [["--model", "tandem/engine/diffusion/assets/tiny-sdar", *DOC_ARGS]]


def test_every_documented_serve_command_builds_its_deployment(tiny_ar):
    """Protects the docs against drift: each documented command is accepted by `tandem serve`'s parser and builds a
    cluster configuration and worker specs (a co-located command without --policy gets the co-located default,
    vllm; a P/D policy on co-located workers would be refused here)."""
    parser = build_parser()
    for where, args in documented_serve_commands():
        ns = parser.parse_args(["serve", *runnable(args, tiny_ar)])
        cfg = serve_cmd._cluster_config(ns)
        specs = ServingCluster(cfg)._specs()
        assert len(specs) == (cfg.colocated or cfg.prefill_workers + cfg.decode_workers), where
        if "--policy" not in args and cfg.colocated:
            assert cfg.policy == "vllm", where


def test_colocated_without_a_policy_picks_vllm_and_pd_keeps_ampd(tiny_ar):
    """Protects the policy default: `--colocated N` alone runs the co-located default (vllm); without --colocated
    the default stays ampd; a named policy is kept."""
    parser = build_parser()

    def policy(*extra: str) -> str:
        return serve_cmd._cluster_config(parser.parse_args(["serve", "--model", str(tiny_ar), *extra])).policy
    assert policy("--colocated", "1") == "vllm"
    assert policy() == "ampd"
    assert policy("--colocated", "2", "--policy", "continuum") == "continuum"


def test_the_documented_colocated_command_serves(tiny_ar, tmp_path):
    """Protects docs/server.md's co-located command live: /health 200 and a completion 200 with tokens."""
    with serve(["--model", str(tiny_ar), *LIVE_AR], tmp_path) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1 and r.json()["usage"]["dllm_chunk"] is None


def test_greedy_diffusion_is_reproducible_under_load_through_the_docs_command(tmp_path):
    """Protects reproducible greedy decoding by default: the committed tiny SDAR served with docs/diffusion.md's
    command; the greedy prompt `words:` sent 10 times, alternately streamed and not, each while sampled requests from
    3 clients are in flight, gives one output, SDAR's reference loop's token for token, each response reporting
    `usage.dllm_chunk` block; the sampled requests report elastic and all succeed."""
    from tokenizers import Tokenizer

    from tandem.engine.diffusion import DllmConfig, generate_reference
    from tandem.engine.loader import load_model
    from tandem.engine.sampling_params import SamplingParams
    model, _ = load_model(SDAR, dtype="float32")
    ids = Tokenizer.from_file(str(SDAR / "tokenizer.json")).encode(GREEDY_PROMPT).ids
    ref = generate_reference(model, ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                             DllmConfig(dllm_confidence_threshold=0.9)).token_ids
    with serve(["--model", str(SDAR), *DOC_ARGS], tmp_path) as url:
        run = greedy_under_load(url)
    assert run.outputs == [ref] * 10
    assert run.modes == ["block"] * 10 and min(run.busy) >= 1
    assert run.load_modes == {"elastic"} and run.load_done >= 1 and run.load_failed == 0
