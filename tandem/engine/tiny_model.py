"""Tiny random checkpoints in the Hugging Face layout (Qwen3, Llama or SDAR), written fully offline, for tests and demos.

A directory from `make_tiny_model` loads both here (`load_model`, `Tokenizer.from_pretrained`) and in transformers
(`AutoModelForCausalLM`, `AutoTokenizer`), so the engine can be checked against transformers without downloads.

Besides the tiny sizes (1m, 30m), `REAL_SIZES` are random models with the dimensions of real checkpoints (Qwen3-0.6B
and Qwen3-8B: their config.json, vocabulary of 151936 ids, 40960 positions) for timing the engine on a GPU. Only the
first few hundred ids are covered by the byte-level tokenizer here, which timing does not care about.

`sdar` is the block-diffusion variant (SDAR's config.json: `model_type: "sdar"`, `block_size`, `mask_token_id`): the
byte-level tokenizer plus a `<|mask|>` token, in a vocabulary padded to SDAR_VOCAB_SIZE ids (the ids past the
tokenizer's are never produced by it), so that the LM head costs what a real vocabulary does. `tandem tiny-model
--arch sdar --train` trains it (tandem.engine.diffusion.train) instead of leaving it random.

`llada` is the masked-diffusion variant in LLaDA's own layout (config.json `model_type: "llada"`, OLMo field names,
`mask_token_id`; tensors `model.transformer.blocks.N.q_proj`, ...: tandem.engine.models.llada): the byte-level
tokenizer with Llama's BOS and chat template plus LLaDA's mask token `<|mdm_mask|>`, in the same padded vocabulary as
sdar (SDAR_VOCAB_SIZE), untied as LLaDA-8B. It loads in tandem only (transformers needs LLaDA's remote code).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tandem.engine.tiny_options import (ARCHS, DEFAULT_ARCH, DEFAULT_DTYPE, DEFAULT_SIZE, REAL_SIZES,  # noqa: F401
                                        SDAR_BLOCK_SIZE, SIZES)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TRANSFORMERS_VERSION = "4.51.0"

# (arch, size) -> shape; vocab comes from the tokenizer (about 400 ids, padded to a multiple of 64).
_SHAPES: dict[tuple[str, str], dict[str, int]] = {
    ("qwen3", "1m"): dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=48, intermediate_size=384),
    # SDAR's body (the vocabulary adds SDAR_VOCAB_SIZE x hidden, tied); 4 KV heads: with 2, the trained model
    # learnt copy and reverse far more slowly
    ("sdar", "1m"): dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=32, intermediate_size=384),
    # LLaDA's head_dim is d_model // n_heads
    ("llada", "1m"): dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                          head_dim=32, intermediate_size=384),
    ("llama", "1m"): dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, intermediate_size=416),
    ("qwen3", "30m"): dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=64, intermediate_size=1920),
    ("llama", "30m"): dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=64, intermediate_size=1920),
    # Qwen/Qwen3-0.6B config.json: 28 layers, hidden 1024, 16 heads (8 KV) of 128, MLP 3072, tied embeddings.
    ("qwen3", "0.6b"): dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, intermediate_size=3072),
    # Qwen/Qwen3-8B config.json: 36 layers, hidden 4096, 32 heads (8 KV) of 128, MLP 12288, untied embeddings.
    ("qwen3", "8b"): dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=12288),
}
# What the real checkpoints' config.json say besides the shape (both Qwen3 sizes alike, but the tying).
_REAL = {("qwen3", "0.6b"): dict(vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True),
         ("qwen3", "8b"): dict(vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False)}

SDAR_VOCAB_SIZE = 32768          # the sdar checkpoints' vocabulary (the tokenizer covers its first few hundred ids)
MASK_TOKEN = "<|mask|>"          # their mask token (config.json `mask_token_id`)
LLADA_MASK_TOKEN = "<|mdm_mask|>"  # LLaDA's mask token (id 126336 in LLaDA-8B)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
# Added but not special (decode keeps them), as in Qwen3: the tool-call and reasoning markers.
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Pieces that become single tokens through left-to-right merges (a space prefix is the byte-level 'Ġ').
_PIECES = [" the", " and", " to", " of", " a", " in", " is", " you", " that", " it", " for", " on", " with",
           " are", " be", " this", " can", " what", " how", " I", " we", " tool", " call", " name", " user",
           " weather", " city", " result", " function", " assistant", " system", "ing", "ed", "er", "es", "on",
           "the", "name", "arguments", "content", "\n\n", "  ", "    ", "\":", " \"", "{\"", "\"}", "\",", "()"]

QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- raise_exception('a system message may only come first') }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}
{{- message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}
{{- '\\n' }}
{%- endif %}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}
{{- fn.arguments }}
{%- else %}
{{- fn.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

LLAMA_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content %}
{%- set rest = messages[1:] %}
{%- else %}
{%- set system = '' %}
{%- set rest = messages %}
{%- endif %}
{%- if system or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}
{%- if tools %}
{%- if system %}
{{- '\\n\\n' }}
{%- endif %}
{{- 'You have access to the following functions. To call one, reply with JSON of the form ' }}
{{- '{"name": function name, "parameters": dictionary of argument name and its value}.\\n' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson(indent=4)) }}
{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in rest %}
{%- if message.role in ['user', 'assistant', 'system'] and not message.tool_calls %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- elif message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{%- if fn.arguments is string %}
{{- '{"name": "' + fn.name + '", "parameters": ' + fn.arguments + '}' }}
{%- else %}
{{- '{"name": "' + fn.name + '", "parameters": ' + (fn.arguments | tojson) + '}' }}
{%- endif %}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif message.role in ['tool', 'ipython'] %}
{%- if message.content is string %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (message.content | tojson) + '<|eot_id|>' }}
{%- endif %}
{%- else %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def _byte_chars() -> list[str]:
    """The byte-level alphabet: the character standing for each byte 0..255 (GPT-2's printable mapping)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer(bos_token: str | None = None, mask_token: str | None = None):
    """A byte-level BPE `tokenizers.Tokenizer`: 256 byte tokens, merges for common pieces, special tokens.

    With `bos_token`, a post-processor prepends it when special tokens are added (as Llama 3's tokenizer does);
    `mask_token` adds a diffusion mask token after every other (a special token: decoding skips it).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = _byte_chars()
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    for piece in _PIECES:
        chars = [alphabet[b] for b in piece.encode("utf-8")]
        left = chars[0]
        for c in chars[1:]:
            if left + c not in vocab:
                vocab[left + c] = len(vocab)
                merges.append((left, c))
            left += c
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    if mask_token is not None:
        tok.add_special_tokens([AddedToken(mask_token, special=True, normalized=False)])
    if bos_token is not None:
        bos_id = tok.token_to_id(bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)])
    return tok


def _check(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (valid: {', '.join(ARCHS)})")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (valid: {', '.join(SIZES)})")
    if (arch, size) not in _SHAPES:
        valid = ", ".join(s for s in SIZES if (arch, s) in _SHAPES)
        if size in REAL_SIZES:
            raise ValueError(f"size {size!r} is a real model's shape, only for qwen3 ({arch}: {valid})")
        raise ValueError(f"size {size!r} is not made for {arch} (valid: {valid})")


def arch_tokenizer(arch: str):
    """The tokenizer an arch's checkpoints ship: Llama's prepends BOS, SDAR's has the mask token."""
    if arch == "llama":
        return build_tokenizer("<|begin_of_text|>")
    if arch == "llada":
        return build_tokenizer("<|begin_of_text|>", mask_token=LLADA_MASK_TOKEN)
    return build_tokenizer(mask_token=MASK_TOKEN if arch == "sdar" else None)


def _vocab_size(arch: str, size: str, tok) -> int:
    """The real model's vocabulary for REAL_SIZES, SDAR_VOCAB_SIZE for the diffusion archs, else the tokenizer's
    padded to 64."""
    if arch in ("sdar", "llada"):
        return SDAR_VOCAB_SIZE
    real = _REAL.get((arch, size))
    return real["vocab_size"] if real else -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64


def _default_tie(arch: str, size: str) -> bool:
    real = _REAL.get((arch, size))
    return real["tie_word_embeddings"] if real else arch in ("qwen3", "sdar")


def model_config(arch: str = DEFAULT_ARCH, size: str = DEFAULT_SIZE, dtype: str = DEFAULT_DTYPE,
                 tie_word_embeddings: bool | None = None) -> dict[str, Any]:
    """The config.json that `make_tiny_model` writes for `arch` and `size` (no weights)."""
    _check(arch, size)
    tok = arch_tokenizer(arch)
    tie = _default_tie(arch, size) if tie_word_embeddings is None else bool(tie_word_embeddings)
    return _model_config(arch, size, _vocab_size(arch, size, tok), tok, tie, dtype)


def _model_config(arch: str, size: str, vocab_size: int, tok, tie: bool, dtype: str) -> dict[str, Any]:
    shape = _SHAPES[(arch, size)]
    max_pos = _REAL[(arch, size)]["max_position_embeddings"] if (arch, size) in _REAL else 4096
    common = dict(vocab_size=vocab_size, **shape, hidden_act="silu", max_position_embeddings=max_pos,
                  rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
                  tie_word_embeddings=tie, use_cache=True, torch_dtype=dtype,
                  transformers_version=_TRANSFORMERS_VERSION)
    if arch == "llada":
        return _llada_config(shape, vocab_size, tok, tie, dtype)
    if arch == "sdar":       # SDAR's config.json: Qwen3's fields plus block_size and mask_token_id
        return dict(architectures=["SDARForCausalLM"], model_type="sdar", **common, rope_theta=1000000.0,
                    rope_scaling=None, use_sliding_window=False, sliding_window=None,
                    max_window_layers=shape["num_hidden_layers"], block_size=SDAR_BLOCK_SIZE,
                    mask_token_id=tok.token_to_id(MASK_TOKEN), bos_token_id=tok.token_to_id("<|endoftext|>"),
                    eos_token_id=tok.token_to_id("<|endoftext|>"))
    if arch == "qwen3":
        return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **common, rope_theta=1000000.0,
                    rope_scaling=None, use_sliding_window=False, sliding_window=None,
                    max_window_layers=shape["num_hidden_layers"],
                    bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=tok.token_to_id("<|im_end|>"))
    # Llama-3.1-style scaled RoPE, with a short original context so all three frequency bands are exercised.
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", **common, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 512},
                mlp_bias=False, pretraining_tp=1, bos_token_id=tok.token_to_id("<|begin_of_text|>"),
                eos_token_id=[tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")])


def _llada_config(shape: dict[str, int], vocab_size: int, tok, tie: bool, dtype: str) -> dict[str, Any]:
    """LLaDA-8B's config.json fields (OLMo names, its Llama block) for this shape."""
    return dict(architectures=["LLaDAModelLM"], model_type="llada", activation_type="silu", alibi=False,
                attention_layer_norm=False, block_type="llama", d_model=shape["hidden_size"],
                n_heads=shape["num_attention_heads"], n_kv_heads=shape["num_key_value_heads"],
                n_layers=shape["num_hidden_layers"], mlp_hidden_size=shape["intermediate_size"], mlp_ratio=4,
                embedding_size=vocab_size, vocab_size=vocab_size, include_bias=False, include_qkv_bias=False,
                bias_for_layer_norm=False, layer_norm_type="rms", layer_norm_with_affine=True, rms_norm_eps=1e-5,
                rope=True, rope_full_precision=True, rope_theta=500000.0, max_sequence_length=4096,
                scale_logits=False, input_emb_norm=False, weight_tying=tie, flash_attention=False, use_cache=False,
                torch_dtype=dtype, mask_token_id=tok.token_to_id(LLADA_MASK_TOKEN),
                bos_token_id=tok.token_to_id("<|begin_of_text|>"),
                eos_token_id=[tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|eot_id|>")],
                pad_token_id=tok.token_to_id("<|endoftext|>"), transformers_version=_TRANSFORMERS_VERSION)


def init_weights(model: torch.nn.Module, seed: int, tied: bool, dtype: torch.dtype = torch.float32,
                  device: str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded random weights, scaled so that greedy decoding of the random model wanders instead of repeating.

    Input projections N(0, 1/fan_in), output projections (o_proj, down_proj) three times wider so the layers
    dominate the residual stream, embeddings N(0, 0.05) when tied to the output head (else 0.5, head 0.1), and
    norm weights drawn around 1 so that a norm loaded into the wrong place shows in the logits.

    Each tensor is drawn in float32 on `device` (its own generator: the values depend on the seed and the device
    type), converted to `dtype` and moved to the CPU before the next is drawn, so a large model never exists in
    float32 as a whole.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    from tandem.engine.loader import checkpoint_layout

    # Hugging Face names and shapes (merged q/k/v and gate/up parameters split back into their checkpoint parts)
    for name, (_param, _off, shape) in checkpoint_layout(model).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * (torch.rand(shape, generator=g, device=device) - 0.5)
        elif name.endswith("bias"):
            t = torch.zeros(shape, device=device)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=g, device=device) * (0.05 if tied else 0.5)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=g, device=device) * 0.1
        else:
            std = (3.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0) / shape[1] ** 0.5
            t = torch.randn(shape, generator=g, device=device) * std
        out[name] = t.to(dtype).contiguous().cpu()
        del t
    return out


def _save_weights(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for name in names:      # contiguous runs of roughly equal bytes, every shard non-empty
        t = tensors[name]
        i = min(shards - 1, acc * shards // max(total, 1))
        groups[i].append(name)
        acc += t.numel() * t.element_size()
    groups = [g for g in groups if g]
    weight_map = {}
    for i, g in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in g}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(g, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(out_dir: str | os.PathLike, arch: str = DEFAULT_ARCH, size: str = DEFAULT_SIZE, seed: int = 0,
                    dtype: str = DEFAULT_DTYPE, shards: int = 1, tie_word_embeddings: bool | None = None,
                    init_device: str = "cpu", config_overrides: dict[str, Any] | None = None) -> Path:
    """Write a random `arch` model of about `size` parameters, its tokenizer and chat template into out_dir.

    init_device: where the random weights are drawn ("cuda" draws an 8B model in seconds; the values then differ
    from a CPU draw of the same seed, but are the same on every run). config_overrides: config.json fields to
    change (a test's other shape, e.g. num_key_value_heads)."""
    _check(arch, size)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (valid: {', '.join(_DTYPES)})")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
    tie = _default_tie(arch, size) if tie_word_embeddings is None else bool(tie_word_embeddings)
    config = {**model_config(arch, size, dtype, tie), **(config_overrides or {})}

    from tandem.engine.models import LlamaForCausalLM, ModelConfig, get_model_class
    mc = ModelConfig.from_dict(config)
    with torch.device("meta"):     # llada: drawn under Llama's names (the init rules read them), then renamed
        skeleton = (LlamaForCausalLM if arch == "llada" else get_model_class(mc.architecture))(mc)
    tensors = init_weights(skeleton, seed, tie, _DTYPES[dtype], init_device)
    if arch == "llada":
        from tandem.engine.models.llada import llada_checkpoint_name
        tensors = {llada_checkpoint_name(n): t for n, t in tensors.items()}
    return write_checkpoint(out_dir, config, tensors, shards)


def write_checkpoint(out_dir: str | os.PathLike, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                     shards: int = 1) -> Path:
    """Write `config` (a `model_config` dict), the named tensors and the arch's tokenizer files into out_dir."""
    arch = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "SDARForCausalLM": "sdar",
            "LLaDAModelLM": "llada"}[config["architectures"][0]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)      # a rewrite must not leave another layout's shards behind
    tok = arch_tokenizer(arch)
    _save_weights(tensors, out, shards)
    _write_json(out / "config.json", config)
    eos = config["eos_token_id"]
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": eos if isinstance(eos, list) else
        list(dict.fromkeys([eos, tok.token_to_id("<|endoftext|>")])), "transformers_version": _TRANSFORMERS_VERSION})
    tok.save(str(out / "tokenizer.json"))
    if arch == "qwen3":
        special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        template = QWEN3_CHAT_TEMPLATE
    elif arch == "sdar":     # SDAR-*-Chat: EOS <|endoftext|>, Qwen3's template, a mask token
        special = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "mask_token": MASK_TOKEN}
        template = QWEN3_CHAT_TEMPLATE
    elif arch == "llada":    # LLaDA-8B-Instruct: Llama 3's template and BOS, a mask token
        special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|endoftext|>",
                   "mask_token": LLADA_MASK_TOKEN}
        template = LLAMA_CHAT_TEMPLATE
    else:   # BOS comes from tokenizer.json's post-processor, as in Llama 3
        special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}
        template = LLAMA_CHAT_TEMPLATE
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "unk_token": None,
        "clean_up_tokenization_spaces": False, "model_max_length":
        config.get("max_position_embeddings", config.get("max_sequence_length")),
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in special.values()],
        "chat_template": template})
    _write_json(out / "special_tokens_map.json", {
        **{k: v for k, v in special.items() if v is not None},
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in special.values()]})
    return out


def parameter_count(arch: str = DEFAULT_ARCH, size: str = DEFAULT_SIZE,
                    tie_word_embeddings: bool | None = None) -> int:
    """Number of distinct parameters of a tiny model (tied embeddings counted once), built on the meta device."""
    from tandem.engine.models import ModelConfig, get_model_class
    mc = ModelConfig.from_dict(model_config(arch, size, "float32", tie_word_embeddings))
    with torch.device("meta"):
        model = get_model_class(mc.architecture)(mc)
    return sum(p.numel() for p in model.parameters())


def widen_vocab(out: str | os.PathLike, vocab: int, seed: int = 0) -> str:
    """The tiny Qwen3 (1m) written to `out` with its tied embedding widened to `vocab` rows (ids past the tokenizer's
    are never produced by it), so the LM head and the logit tensor cost what a real vocabulary's do."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    make_tiny_model(out, arch="qwen3", size="1m", seed=seed)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    tensors["model.embed_tokens.weight"] = torch.randn(vocab, cfg["hidden_size"], generator=g) * 0.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)
