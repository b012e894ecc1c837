"""The tiny checkpoints' architecture and size names, without torch, so that building the CLI's parser
(`tandem tiny-model --arch/--size` choices) does not import it (tandem.engine.tiny_model re-exports them)."""

ARCHS = ("qwen3", "llama", "sdar", "llada")
REAL_SIZES = ("0.6b", "8b")          # qwen3 only: the real models' shapes
SIZES = ("1m", "30m", *REAL_SIZES)
