"""Profiled engine steps against the roofline: the catalogue's GPU and model for a profile, and measured/predicted."""
from __future__ import annotations

import statistics

from tandem.perf.models import MODELS, ModelSpec
from tandem.perf.batch_shape import BatchShape
from tandem.perf.roofline import Roofline

KINDS = ("prefill", "decode", "mixed")
SHAPE_FIELDS = ("prefill_tokens", "prefill_attn_pairs", "prefill_kv_read_tokens", "num_prefill", "num_decode",
                "decode_ctx_tokens")
GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("H20", "h20"), ("A100", "a100-80g"), ("L40S", "l40s"),
             ("4090", "rtx4090"))


def gpu_key(device_name: str) -> str | None:
    """The perf catalogue's GPU for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100'), or None."""
    for needle, key in GPU_NAMES:
        if needle.lower() in device_name.lower():
            return key
    return None


def model_spec(model_config: dict) -> ModelSpec:
    """The perf catalogue's ModelSpec of the profiled checkpoint's shape, or one built from its numbers."""
    mc = model_config
    shape = (mc["layers"], mc["hidden"], mc["heads"], mc["kv_heads"], mc["head_dim"], mc["intermediate"], mc["vocab"])
    for spec in MODELS.values():
        if not spec.is_moe and (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim,
                                spec.intermediate, spec.vocab) == shape:
            return spec
    untied = ModelSpec("checkpoint", *shape, max_context=mc.get("max_position_embeddings", 131072))
    # the engine counts the q/k norms too; a tied checkpoint has one vocab x hidden matrix fewer
    tied = mc.get("params", untied.params) < untied.params - untied.vocab * untied.hidden // 2
    return ModelSpec("checkpoint", *shape, max_context=untied.max_context, tied_embeddings=tied)


def ratio_summary(xs: list[float]) -> dict:
    """Count, median, min and max of some ratios ({"n": 0} when there are none)."""
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {"n": 0}


def analyse_profile(prof: dict, gpu: str | None = None) -> dict:
    """Every measured step of a profile.json against the roofline: rows and the ratio's summary by kind."""
    device = prof.get("device", {})
    gpu = gpu or gpu_key(device.get("name", ""))
    if gpu is None:
        raise ValueError(f"cannot tell the GPU of device {device.get('name')!r}: give --gpu")
    spec = model_spec(prof["model_config"])
    roof = Roofline(spec, gpu, tp=1)
    rows = []
    for r in prof["measurements"]:
        shape = BatchShape(*(r[f] for f in SHAPE_FIELDS))
        b = roof.breakdown(shape)
        rows.append({"kind": r["kind"], "split": r.get("split"), **{f: r[f] for f in SHAPE_FIELDS},
                     "measured_s": r["seconds"], "roofline_s": b["total"], "bound": b["bound"],
                     "ratio": r["seconds"] / b["total"]})
    by_kind = {k: ratio_summary([x["ratio"] for x in rows if x["kind"] == k]) for k in KINDS}
    by_bound = {k: ratio_summary([x["ratio"] for x in rows if x["bound"] == k]) for k in ("compute", "memory")}
    opts = prof.get("options", {})
    return {"mode": "eager" if opts.get("enforce_eager") else "graphs", "gpu": gpu, "model": spec.name,
            "device": device, "torch_version": prof.get("torch_version"), "created": prof.get("created"),
            "wall_s": prof.get("wall_s"), "profiled_max_len": opts.get("profiled_max_len"),
            "max_model_len": prof.get("max_model_len"), "block_size": prof.get("block_size"),
            "num_blocks": prof.get("num_blocks"), "heldout_error": prof.get("heldout_error"),
            "all": ratio_summary([x["ratio"] for x in rows]), "by_kind": by_kind, "by_bound": by_bound, "rows": rows}


