"""Load a Hugging Face checkpoint directory (config.json + safetensors, single or sharded) into an engine model."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

from tandem.engine.attention.registry import get_backend
from tandem.engine.models import ModelConfig, get_model_class
from tandem.engine.parallel.group import SINGLE, TPGroup, building

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".inv_freq")


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded: missing files, unknown architecture, or weights that do not fit."""


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (valid: float32, float16, bfloat16)") from None


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: from model.safetensors.index.json, model.safetensors, or *.safetensors."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e})") from None
        files = [p / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index.name} lists shard files missing from {p}: {', '.join(absent[:5])}")
        return files
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {p}")
    return files


def _few(names: list[str] | set[str], n: int = 5) -> str:
    names = sorted(names)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _load_slice(param: torch.Tensor, off: int, tensor_slice, cut: tuple[int, int, int]) -> None:
    """Read only this rank's slice of a checkpoint tensor into its parameter: rows [first, first + count) from row
    `off` of the parameter (dim 0: column-parallel, vocabulary) or its columns (dim 1: row-parallel)."""
    dim, first, count = cut
    if dim == 0:
        param[off:off + count].copy_(tensor_slice[first:first + count])
    else:
        param.copy_(tensor_slice[:, first:first + count])


def checkpoint_layout(model: torch.nn.Module) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """Checkpoint tensor name -> (parameter name, row offset, shape) of the model's parameters.

    Models with merged parameters (qkv_proj, gate_up_proj) say how the Hugging Face tensors stack into them
    (`checkpoint_layout()`); for any other model each parameter is the checkpoint tensor of the same name.
    """
    if hasattr(model, "checkpoint_layout"):
        return model.checkpoint_layout()
    return {n: (n, 0, tuple(t.shape)) for n, t in model.named_parameters()}


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The checkpoint directory's config.json as a ModelConfig (ModelLoadError, one line, when it is not one)."""
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p} has no config.json (not a Hugging Face checkpoint directory)")
    try:
        return ModelConfig.from_pretrained(p)
    except ValueError as e:
        raise ModelLoadError(f"{p}: {e}") from None


def load_model(path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               backend: str | None = None, *,
               dtype_for: Callable[[str | None], torch.dtype] | None = None,
               tp: TPGroup = SINGLE) -> tuple[torch.nn.Module, ModelConfig]:
    """Build the checkpoint's model on `device` in `dtype` (else dtype_for(checkpoint dtype), else the checkpoint's);
    under tensor parallelism (`tp`), this rank's shard, reading only its slices of the weights."""
    p = Path(path)
    cfg = read_config(p)
    if dtype is not None:
        dt = _as_dtype(dtype)
    elif dtype_for is not None:
        dt = dtype_for(cfg.torch_dtype)
    else:
        dt = DTYPES.get(cfg.torch_dtype or "", torch.float32)
    dev = torch.device(device)
    files = weight_files(p)
    try:
        attn = get_backend(backend, dev)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None

    with torch.device("meta"), building(tp):
        model = get_model_class(cfg.architecture)(cfg, attn)
    model = model.to(dtype=dt).to_empty(device=dev)
    model.tie_weights()
    params = dict(model.named_parameters())   # tied lm_head.weight is deduplicated away
    layout = checkpoint_layout(model)         # checkpoint name -> (parameter, row offset, shape)
    slices = model.checkpoint_slices() if tp.size > 1 else {}   # name -> (dim, first, count) of this rank's part

    from safetensors import safe_open
    plan: list[tuple[Path, list[str]]] = []
    seen: set[str] = set()
    unexpected: list[str] = []
    bad_shapes: list[str] = []
    for f in files:
        names = []
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if name not in layout:
                    unexpected.append(name)
                    continue
                shape = tuple(sf.get_slice(name).get_shape())
                want = layout[name][2]
                if shape != want:
                    bad_shapes.append(f"{name} is {list(shape)} in {f.name}, model expects {list(want)}")
                    continue
                if name not in seen:
                    seen.add(name)
                    names.append(name)
        plan.append((f, names))
    if bad_shapes:
        raise ModelLoadError(f"{p}: shape mismatch for {len(bad_shapes)} tensor(s): {'; '.join(bad_shapes[:3])}")
    if unexpected:
        raise ModelLoadError(f"{p}: {len(unexpected)} unexpected tensor(s) for {cfg.architecture}: {_few(unexpected)}")
    missing = set(layout) - seen
    if missing:
        raise ModelLoadError(f"{p}: {len(missing)} tensor(s) missing from the checkpoint: {_few(missing)}")

    load_dev = str(dev) if dev.type == "cuda" else "cpu"
    with torch.no_grad():
        for f, names in plan:
            with safe_open(str(f), framework="pt", device=load_dev) as sf:
                for name in names:
                    pname, off, shape = layout[name]
                    if name in slices:
                        _load_slice(params[pname], off, sf.get_slice(name), slices[name])
                    else:
                        params[pname][off:off + shape[0]].copy_(sf.get_tensor(name))   # a merged part: its rows
        for mod in model.modules():           # a vocabulary slice's padding rows (the last rank's) are zero
            if getattr(mod, "vocab_shard", None) is not None:
                mod.weight[mod.vocab_shard[1]:].zero_()
    model.requires_grad_(False)
    model.eval()
    return model, cfg
