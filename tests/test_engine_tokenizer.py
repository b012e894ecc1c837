"""The engine tokenizer (tokenizer.json + jinja chat template) against transformers, and `tandem tiny-model`."""
from __future__ import annotations

import argparse
import json
import sys

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.engine.tokenizer import Tokenizer, TokenizerError  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Zürich? 天気"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
    {"role": "tool", "content": "second result"},
    {"role": "assistant", "content": "It is 21 °C and clear."},
    {"role": "user", "content": "Thanks!"},
]
TEXTS = ["Hello, world!", "  leading and trailing spaces  ", "naïve café — 日本語のテキスト, 한국어, العربية",
         "emoji 😀👍🏽 and ZWJ 👩‍👩‍👧", "tabs\tand\nnewlines\r\n", "e\u0301 combining",
         "{\"name\": \"x\"} <tool_call>", ""]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {a: make_tiny_model(root / a, a, "1m") for a in ("qwen3", "llama")}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_encode_decode_round_trip(dirs, arch):
    """Protects: byte-level BPE round-trips arbitrary unicode; Llama's BOS comes from the post-processor."""
    tok = Tokenizer.from_pretrained(dirs[arch])
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("hi")
    assert (ids[0] == tok.bos_token_id) == (arch == "llama")
    assert tok.vocab_size >= 256 and all(0 <= i < tok.vocab_size for i in tok.encode(TEXTS[2]))
    specials = tok.encode("<|im_start|>x<|im_end|>", add_special_tokens=False)
    assert specials[0] == tok.token_to_id("<|im_start|>") and tok.decode(specials) == "x"


def test_eos_ids(dirs):
    """Protects: EOS ids come from generation_config/config plus the tokenizer's eos_token."""
    q = Tokenizer.from_pretrained(dirs["qwen3"])
    assert set(q.eos_token_ids) == {q.token_to_id("<|im_end|>"), q.token_to_id("<|endoftext|>")}
    llama = Tokenizer.from_pretrained(dirs["llama"])
    assert set(llama.eos_token_ids) == {llama.token_to_id("<|eot_id|>"), llama.token_to_id("<|end_of_text|>")}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_chat_template_matches_transformers(dirs, arch):
    """Protects: prompts render exactly as transformers' apply_chat_template (system/user/assistant/tool
    messages, tool calls, generation prompt), with and without tools, so the engine sees the same tokens."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(dirs[arch])
    tok = Tokenizer.from_pretrained(dirs[arch])
    for tools in (None, TOOLS):
        for messages in (CHAT, CHAT[:2], CHAT[1:2], CHAT[:4]):
            for gen in (True, False):
                ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen)
                ref = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
                assert ours == ref
    text = tok.apply_chat_template(CHAT, tools=TOOLS)
    assert "get_weather" in text and "Zürich" in text
    assert tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=True) == tok.encode(text, add_special_tokens=False)
    if arch == "qwen3":
        assert text.endswith("<|im_start|>assistant\n") and "<tool_response>" in text
        no_think = tok.apply_chat_template(CHAT[:2], enable_thinking=False)
        assert no_think == hf.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False,
                                                  enable_thinking=False)
        assert no_think.endswith("<think>\n\n</think>\n\n")


def test_tokenizer_errors(dirs, tmp_path):
    """Protects: clear ValueErrors for a missing directory or tokenizer.json, no chat template, template errors."""
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "empty")
    d = make_tiny_model(tmp_path / "nochat", "qwen3", "1m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(d)
    assert tok.encode("ok") and issubclass(TokenizerError, ValueError)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(CHAT)
    q = Tokenizer.from_pretrained(dirs["qwen3"])
    with pytest.raises(TokenizerError, match="unknown role"):
        q.apply_chat_template([{"role": "robot", "content": "x"}])


# --------------------------------------------------------------------------- tiny-model command


def _run_cli(argv, capsys):
    """The tiny-model subcommand under a parser built like tandem's (usage errors raise CLIError -> exit 2)."""
    from tandem.cli import tiny_cmd
    from tandem.cli.common import CLIError, Parser

    parser = Parser(prog="tandem")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    tiny_cmd.add_parser(sub)
    try:
        args = parser.parse_args(argv)
        rc = int(args.func(args) or 0)
    except CLIError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        rc = 2
    out, err = capsys.readouterr()
    return rc, out, err


def test_tiny_model_cli(tmp_path, capsys):
    """Protects: `tandem tiny-model` writes a loadable HF-layout checkpoint and exits 0; bad input exits 2
    with a single-line error."""
    out = tmp_path / "m"
    rc, stdout, err = _run_cli(["tiny-model", "--arch", "llama", "--size", "1m", "--out", str(out),
                                "--seed", "3", "--shards", "2"], capsys)
    assert rc == 0, err
    assert "parameters" in stdout
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "model.safetensors.index.json",
                 "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert not cfg["tie_word_embeddings"]

    rc, _, err = _run_cli(["tiny-model", "--size", "2m", "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and err.startswith("tandem: error:") and len(err.strip().splitlines()) == 1
    assert "--size" in err

    rc, _, err = _run_cli(["tiny-model", "--out", str(out)], capsys)          # non-empty without --force
    assert rc == 2 and "not empty" in err and len(err.strip().splitlines()) == 1

    rc, _, err = _run_cli(["tiny-model", "--out", str(out), "--force"], capsys)
    assert rc == 0 and (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors.index.json").exists() and not list(out.glob("model-*"))


def test_tiny_model_via_main_when_registered(tmp_path, capsys):
    """Protects: once main.py registers tiny_cmd, `tandem tiny-model` works end to end."""
    from tandem.cli import main as cli_main

    subs = [a for a in cli_main.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs or "tiny-model" not in subs[0].choices:
        pytest.skip("tiny-model is not registered in tandem.cli.main yet")
    assert cli_main.main(["tiny-model", "--out", str(tmp_path / "q")]) == 0
    assert cli_main.main(["tiny-model", "--size", "huge", "--out", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
