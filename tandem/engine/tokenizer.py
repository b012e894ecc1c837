"""A Hugging Face checkpoint's tokenizer (tokenizer.json) and chat template, without transformers.

Chat templates render in the same sandboxed jinja2 environment transformers uses (trim_blocks, lstrip_blocks,
loop controls, a non-escaping `tojson`, `raise_exception`, `strftime_now`), with the same variables (messages,
tools, documents, add_generation_prompt, the special tokens as strings, and any extra keyword arguments), so a
prompt renders to the same string here as with `AutoTokenizer.apply_chat_template`.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Sequence

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used: missing files or no chat template."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


class Tokenizer:
    """Encode/decode with a checkpoint's tokenizer.json, its EOS ids, and its jinja chat template."""

    def __init__(self, tokenizer: Any, *, chat_template: str | dict[str, str] | None = None,
                 special_tokens: dict[str, str] | None = None, add_bos_token: bool = False,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.add_bos_token = add_bos_token
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = tokenizer.token_to_id(bos) if bos else None
        eos = self.special_tokens.get("eos_token")
        ids = list(eos_token_ids)
        eos_id = tokenizer.token_to_id(eos) if eos else None
        if eos_id is not None:
            ids.append(eos_id)
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json (+ chat_template.jinja) and the EOS ids of a checkpoint dir."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path)
        if not p.is_dir():
            raise TokenizerError(f"tokenizer directory {p} does not exist")
        if not (p / "tokenizer.json").is_file():
            raise TokenizerError(f"{p} has no tokenizer.json (only fast, tokenizers-format tokenizers are supported)")
        try:
            tok = HFTokenizer.from_file(str(p / "tokenizer.json"))
        except Exception as e:  # the Rust library raises a plain Exception
            raise TokenizerError(f"{p / 'tokenizer.json'} cannot be loaded: {e}") from None
        tc = _read_json(p / "tokenizer_config.json")
        special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(tc.get(k))) is not None}
        template: Any = tc.get("chat_template")
        if isinstance(template, list):    # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}
        if template is None and (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None and (p / "chat_template.json").is_file():
            template = _read_json(p / "chat_template.json").get("chat_template")
        eos = _as_ids(_read_json(p / "generation_config.json").get("eos_token_id"))
        eos += _as_ids(_read_json(p / "config.json").get("eos_token_id"))
        return cls(tok, chat_template=template, special_tokens=special,
                   add_bos_token=bool(tc.get("add_bos_token", False)), eos_token_ids=eos)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special tokens: those `decode(..., skip_special_tokens=True)` leaves out."""
        added = getattr(self._tok, "get_added_tokens_decoder", None)
        return frozenset(i for i, t in added().items() if t.special) if added is not None else frozenset()

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string, or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of one id, or None."""
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, the tokenizer's post-processor (and BOS if configured) apply."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _template(self, tools: Any) -> str:
        t = self.chat_template
        if isinstance(t, dict):
            if tools and "tool_use" in t:
                return t["tool_use"]
            t = t.get("default")
        if not t:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                                 "or chat_template.jinja)")
        return t

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            documents: Sequence[dict[str, Any]] | None = None, **kwargs: Any) -> str | list[int]:
        """Render a conversation with the chat template (as transformers does); token ids when tokenize=True."""
        source = self._template(tools)
        chat = [_alias_reasoning(_plain(m)) for m in messages]
        for m in chat:
            if not isinstance(m, dict):
                raise TokenizerError(f"chat messages must be dicts, got {m!r}")
        variables = {**self.special_tokens, **_plain(kwargs)}
        import jinja2
        try:
            text = _compile(source).render(messages=chat, tools=_plain(list(tools)) if tools is not None else None,
                                         documents=_plain(list(documents)) if documents is not None else None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template error: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _plain(value: Any) -> Any:
    """A deep copy made of JSON types only, so the sandboxed template sees no live objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: Any) -> Any:
    """Expose a message's reasoning under every name templates read (reasoning_content, thinking), as HF does."""
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=16)
def _compile(template: str):
    """Compile a chat template in transformers' sandboxed environment."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
