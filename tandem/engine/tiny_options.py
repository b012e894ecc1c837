"""What `tandem tiny-model` makes: the architectures and sizes of the tiny checkpoints (tandem.engine.tiny_model)
and the knobs of the maker and of its SDAR training (tandem.engine.diffusion.train), declared once (tandem.knob) so
the command's flags are generated from these fields. Imports no torch: the flags are built without it."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.knob import csv_list, knob, nonneg_int, positive_int, seed

ARCHS = ("qwen3", "llama", "sdar", "llada")
REAL_SIZES = ("0.6b", "8b")          # qwen3 only: the real models' shapes
SIZES = ("1m", "30m", *REAL_SIZES)
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_ARCH = "qwen3"
DEFAULT_SIZE = "1m"
DEFAULT_DTYPE = "float32"            # a random checkpoint's weights
SDAR_BLOCK_SIZE = 32                 # the sdar checkpoints' diffusion block length (config.json `block_size`)

# The training run that made the committed tiny SDAR checkpoint (TrainConfig's defaults, docs/diffusion.md).
TRAIN_STEPS = 3200
TRAIN_AR_STEPS = 0
TRAIN_THREADS = 2                    # the weights depend on the count (float reductions split differently)
TRAIN_BLOCK_SIZES = (1, 2, 4, 8, 16, 32)
TRAIN_DTYPE = "bfloat16"


def _sizes(sizes: tuple[int, ...]) -> str:
    return ",".join(map(str, sizes))


@dataclass(slots=True)
class TinyModelOptions:
    """Which tiny checkpoint to write and where; with `train`, how to train the SDAR one (None: TrainConfig's)."""

    arch: str = knob(DEFAULT_ARCH, "architecture", choices=ARCHS)
    size: str = knob(DEFAULT_SIZE, "about 1M or 30M parameters, or (qwen3 only) the shape of Qwen3-0.6B or Qwen3-8B with "
                     "their 151936-id vocabulary", choices=SIZES)
    out: str | None = knob(None, "directory to write (created if missing)", metavar="DIR")
    seed: int = knob(0, "weight seed", parse=seed)
    shards: int = knob(1, "split the weights into K safetensors files with an index", parse=positive_int,
                       metavar="K")
    dtype: str | None = knob(None, f"weight dtype (default: {DEFAULT_DTYPE}; with --train, {TRAIN_DTYPE})",
                             choices=DTYPES)
    tie_embeddings: bool | None = knob(None, "tie lm_head to the input embeddings (default: as the real model: tied "
                                       "for qwen3 except 8b, untied for llama)")
    init_device: str = knob("cpu", "draw the random weights on this torch device, e.g. cuda for the 8b size (same "
                            "seed, other values than on cpu)", metavar="DEVICE")
    force: bool = knob(False, "write into a non-empty directory")
    train: bool = knob(False, "(--arch sdar) train the model with the block-diffusion objective on the synthetic task "
                       f"corpus (seeded by --seed; {TRAIN_THREADS} threads unless --train-threads; a few minutes on "
                       "two cores), then evaluate it")
    train_steps: int | None = knob(None, f"training steps with --train (default: {TRAIN_STEPS}, the committed "
                                   "checkpoint's)", parse=positive_int, metavar="N")
    train_ar_steps: int | None = knob(None, "with --train, SDAR's recipe: N next-token-prediction steps (causal, "
                                      "shifted) before the block-diffusion steps convert the model (default: "
                                      f"{TRAIN_AR_STEPS}, the committed checkpoint's)", parse=nonneg_int, metavar="N")
    train_block_sizes: tuple[int, ...] | None = knob(
        None, "with --train, draw each step's noisy-block size from these divisors of the model's block size "
        f"{SDAR_BLOCK_SIZE} (default: {_sizes(TRAIN_BLOCK_SIZES)}, the committed checkpoint's; {SDAR_BLOCK_SIZE}: "
        f"blocks of {SDAR_BLOCK_SIZE} alone)", parse=csv_list(positive_int), metavar="B[,B...]")
    train_threads: int | None = knob(None, f"with --train, torch threads (default: {TRAIN_THREADS}; the weights "
                                     "depend on the thread count, as float reductions are split differently)",
                                     parse=positive_int, metavar="N")
    eval_examples: int = knob(100, "held-out examples per task evaluated after --train (0: none)", parse=nonneg_int,
                              metavar="N")
