"""`tandem tiny-model`: write a tiny Qwen3, Llama, SDAR or LLaDA checkpoint (HF layout) for tests and demos, offline.

    tandem tiny-model --arch qwen3 --size 1m --out models/tiny-qwen3
    tandem tiny-model --arch llama --size 30m --out models/tiny-llama --shards 2
    tandem tiny-model --size 8b --dtype bfloat16 --shards 4 --init-device cuda --out models/qwen3-8b-random
    tandem tiny-model --arch sdar --train --out models/tiny-sdar     # a trained block-diffusion model, ~5 min
    tandem tiny-model --arch llada --out models/tiny-llada           # a random LLaDA (masked diffusion) model
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tandem.cli.args import add_knobs
from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import CLIError
from tandem.engine.tiny_options import DEFAULT_DTYPE, TinyModelOptions


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `tiny-model` on the subparsers `sub` of the tandem parser."""
    p = sub.add_parser("tiny-model", help=COMMAND_HELP["tiny-model"],
                       description="Write a random model with its config, safetensors weights, byte-level BPE "
                                   "tokenizer and chat template, loadable by tandem (and by transformers, but sdar and "
                                   "llada). "
                                   "--arch sdar --train trains the block-diffusion model on a synthetic task corpus "
                                   "instead (docs/diffusion.md).")
    add_knobs(p, TinyModelOptions, required=("out",))
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
    if args.train:
        return _train(args, out)
    given = [f for f, v in (("--train-steps", args.train_steps), ("--train-ar-steps", args.train_ar_steps),
                            ("--train-threads", args.train_threads), ("--train-block-sizes", args.train_block_sizes))
             if v is not None]
    if given:
        raise CLIError(f"{given[0]} needs --train")
    dtype = args.dtype or DEFAULT_DTYPE
    try:
        make_tiny_model(out, arch=args.arch, size=args.size, seed=args.seed, dtype=dtype, shards=args.shards,
                        tie_word_embeddings=args.tie_embeddings, init_device=args.init_device)
    except (ValueError, OSError, RuntimeError) as e:
        raise CLIError(f"cannot write the tiny model: {e}") from None
    n = parameter_count(args.arch, args.size, args.tie_embeddings)
    print(f"wrote {args.arch} {args.size} ({n:,} parameters, {dtype}, {args.shards} shard(s)) to {out}")
    return 0


def _train(args, out: Path) -> int:
    """--train: train the tiny SDAR model, save it, evaluate it on held-out examples and print the table."""
    if args.arch != "sdar":
        raise CLIError("--train trains the block-diffusion model: give --arch sdar")
    made = TinyModelOptions()                    # the one shape the training makes: the maker's defaults
    if (args.size, args.shards, args.init_device) != (made.size, made.shards, made.init_device) \
            or args.tie_embeddings is False:
        raise CLIError("--train makes the one tiny SDAR shape: leave --size, --shards, --tie-embeddings and "
                       "--init-device at their defaults")
    import shlex
    import sys

    from tandem.engine.diffusion.evaluate import evaluate_checkpoint
    from tandem.engine.diffusion.tasks import eval_set
    from tandem.engine.diffusion.train import TrainConfig, save_trained, train

    try:                                         # before minutes of training: the held-out set must have them
        eval_set(args.eval_examples)
    except ValueError as e:
        raise CLIError(f"--eval-examples {args.eval_examples}: {e}") from None

    given_sizes = {} if args.train_block_sizes is None else {"block_sizes": tuple(args.train_block_sizes)}
    try:
        cfg = TrainConfig(seed=args.seed, **given_sizes)
    except ValueError as e:
        raise CLIError(f"--train-block-sizes: {e}") from None
    if args.train_steps is not None:
        cfg.steps = args.train_steps
    if args.train_ar_steps is not None:
        cfg.ar_steps = args.train_ar_steps
    if args.train_threads is not None:
        cfg.threads = args.train_threads
    if args.dtype is not None:
        cfg.dtype = args.dtype
    command = "tandem " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    result = train(cfg)
    save_trained(result, out, cfg, command)
    ar = f"{cfg.ar_steps} next-token then " if cfg.ar_steps else ""
    sizes = f", blocks of {'/'.join(map(str, cfg.block_sizes))}" if cfg.block_sizes else ""
    print(f"trained tiny SDAR for {ar}{cfg.steps} steps in {result.seconds:.0f} s (seed {cfg.seed}{sizes}, loss of "
          f"the last 50 steps {sum(result.losses[-50:]) / len(result.losses[-50:]):.3f}); wrote {out}")
    if args.eval_examples:
        report = evaluate_checkpoint(out, args.eval_examples)
        print(f"held-out exact match and tokens per step ({args.eval_examples} examples a task, greedy, block "
              f"{report.settings['block_length']}, low_confidence_dynamic at {report.settings['threshold']}):")
        print(report.table())
    return 0
