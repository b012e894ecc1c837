"""`tandem tiny-model`: write a tiny random Qwen3 or Llama checkpoint (HF layout) for tests and demos, offline.

    tandem tiny-model --arch qwen3 --size 1m --out models/tiny-qwen3
    tandem tiny-model --arch llama --size 30m --out models/tiny-llama --shards 2
    tandem tiny-model --size 8b --dtype bfloat16 --shards 4 --init-device cuda --out models/qwen3-8b-random
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tandem.cli.common import CLIError, positive_int, seed_arg


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `tiny-model` on the subparsers `sub` of the tandem parser."""
    from tandem.engine.tiny_model import ARCHS, SIZES

    p = sub.add_parser("tiny-model", help="write a tiny random Qwen3/Llama checkpoint (HF layout) for tests",
                       description="Write a random model with its config, safetensors weights, byte-level BPE "
                                   "tokenizer and chat template, loadable by tandem and by transformers.")
    p.add_argument("--arch", choices=ARCHS, default="qwen3", help="architecture (default: %(default)s)")
    p.add_argument("--size", choices=SIZES, default="1m",
                   help="about 1M or 30M parameters, or (qwen3 only) the shape of Qwen3-0.6B or Qwen3-8B with their "
                        "151936-id vocabulary (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if missing)")
    p.add_argument("--seed", type=seed_arg, default=0, help="weight seed (default: 0)")
    p.add_argument("--shards", type=positive_int, default=1, metavar="K",
                   help="split the weights into K safetensors files with an index (default: 1)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="weight dtype (default: %(default)s)")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="tie lm_head to the input embeddings (default: as the real model: tied for qwen3 except 8b, "
                        "untied for llama)")
    p.add_argument("--init-device", default="cpu", metavar="DEVICE",
                   help="draw the random weights on this torch device, e.g. cuda for the 8b size (same seed, other "
                        "values than on cpu; default: %(default)s)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=cmd_tiny_model)
    return p


def cmd_tiny_model(args) -> int:
    """Write the checkpoint and print one summary line."""
    from tandem.engine.tiny_model import make_tiny_model, parameter_count

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise CLIError(f"--out {out} is not empty (give --force to write into it)")
    try:
        make_tiny_model(out, arch=args.arch, size=args.size, seed=args.seed, dtype=args.dtype, shards=args.shards,
                        tie_word_embeddings=args.tie_embeddings, init_device=args.init_device)
    except (ValueError, OSError, RuntimeError) as e:
        raise CLIError(f"cannot write the tiny model: {e}") from None
    n = parameter_count(args.arch, args.size, args.tie_embeddings)
    print(f"wrote {args.arch} {args.size} ({n:,} parameters, {args.dtype}, {args.shards} shard(s)) to {out}")
    return 0
