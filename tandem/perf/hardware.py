"""GPU catalogue: vendor datasheet peaks plus the few efficiency factors a roofline needs.

Every number here is either a datasheet value (peaks, capacities, link rates) or a documented,
device-independent assumption (efficiency factors, latencies, framework overhead). None is
tuned to make a policy look good; to match a real machine, measure it (`tandem profile`) and fit
the cost functions to the measurements instead of editing these constants.

Units: TFLOPS = 1e12 FLOP/s, GB/s = 1e9 B/s. `hbm_gb` is the datasheet capacity; cards expose
about that many GiB (nvidia-smi: H100 80GB -> 81559 MiB, H20 96GB -> 97871 MiB, A100 80GB ->
81920 MiB), so capacity arithmetic treats it as GiB (see `hbm_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.perf.errors import unknown_name

GIB = 1 << 30

# ---------------------------------------------------------------------------------------------
# Device-independent assumptions (shared by every catalogue entry unless stated otherwise).
# ---------------------------------------------------------------------------------------------
# Model FLOPs utilisation reachable by large bf16 GEMMs / flash attention in a serving engine.
# cuBLAS bf16 GEMMs reach ~70-80% of dense peak on A100/H100 at large shapes; whole-model prefill
# (GEMMs + attention + norms) in vLLM/SGLang lands around 0.6-0.7. One value for all devices.
MFU = 0.7
# Memory-bandwidth utilisation reachable by decode (weight streaming + paged attention):
# STREAM-like copies reach ~90% of HBM peak; serving decode kernels ~75-85%.
MBU = 0.8
# Fraction of link peak a collective or a KV copy achieves: nccl-tests all-reduce bus bandwidth
# on NVSwitch H100 is ~360-370 GB/s of 450 (~0.8); RDMA over IB/RoCE reaches ~90% of line rate
# in microbenchmarks but less through a KV-transfer library. One value for all links.
LINK_EFF = 0.8
# Latency of one hop of a small all-reduce (tree / one-shot schedules use ceil(log2 n) hops).
# vLLM's custom all-reduce and NCCL's LL protocol complete a small (<1 MiB) all-reduce over
# 8 NVLink GPUs in ~5-10 us, i.e. ~3 us per log2 hop. Over PCIe (no NVLink, P2P through the
# PCIe switch or the host) small all-reduces take ~20-40 us at 8 GPUs, ~10 us per hop.
NVLINK_HOP_LATENCY_S = 3e-6
PCIE_HOP_LATENCY_S = 10e-6
# One-way latency of a KV transfer between nodes: one-sided RDMA write ~2-3 us on IB plus
# descriptor posting and completion notification in the transfer library (NIXL/Mooncake-TE).
IB_LATENCY_S = 10e-6
ETH_LATENCY_S = 20e-6  # RoCE/Ethernet NICs typical of PCIe-card servers
# Per-iteration host overhead of a serving engine (scheduler, input preparation, sampling,
# output processing; kernel launches hidden by CUDA graphs for decode). vLLM v1 / SGLang
# spend ~1-3 ms per step outside the GPU kernels; one value for all devices (host-side cost).
STEP_OVERHEAD_S = 2e-3
# Host time to launch one transformer layer's kernels in an eager (not graph-captured) forward: about ten
# kernels a layer (fused add+norm twice, QKV GEMM, rotary, KV store, attention, O GEMM, gate/up GEMM, SiLU-mul,
# down GEMM) at ~6 us of PyTorch dispatch + cudaLaunchKernel each. Launches run ahead of the GPU, so an eager
# step takes max(GPU time, layers x this); a captured CUDA graph launches the whole forward at once. Decode steps
# are assumed captured (vLLM/SGLang default); prefill steps are eager unless they replay a bucket graph (LAPS).
EAGER_LAUNCH_S_PER_LAYER = 60e-6


@dataclass(frozen=True)
class GPU:
    """One accelerator and its links. Bandwidths are per GPU and per direction."""

    name: str
    bf16_tflops: float        # dense (no sparsity) bf16 tensor-core peak, TFLOPS
    hbm_bw_gbs: float         # device memory bandwidth, GB/s
    hbm_gb: float             # device memory capacity, datasheet "GB" (~GiB, see module doc)
    nvlink_gbs: float         # intra-node GPU<->GPU bandwidth per direction (NVLink; PCIe if none)
    net_gbs: float            # inter-node bandwidth per GPU per direction (its share of the NICs)
    gpus_per_node: int = 8
    mfu: float = MFU          # achievable fraction of bf16 peak
    mbu: float = MBU          # achievable fraction of memory bandwidth
    nvlink_latency_s: float = NVLINK_HOP_LATENCY_S   # one all-reduce hop inside a node
    net_latency_s: float = IB_LATENCY_S              # one inter-node transfer (alpha of alpha-beta)
    step_overhead_s: float = STEP_OVERHEAD_S         # per-iteration engine overhead
    eager_launch_s_per_layer: float = EAGER_LAUNCH_S_PER_LAYER   # kernel launches of one layer, eager forward
    link_eff: float = LINK_EFF                       # achievable fraction of link bandwidth
    has_nvlink: bool = True
    fp8_tflops: float = 0.0   # dense fp8 tensor-core peak, TFLOPS (0: no fp8 tensor cores; fp8 runs at bf16 rate)
    arch: str = ""            # architecture family (hopper, ampere, ada, blackwell): derived costs stay inside one
    host_gbs: float = 32.0                           # GPU<->host bandwidth per direction (PCIe; Gen4 x16 ~32 GB/s):
                                                     # what KV preempted by swap moves over

    @property
    def flops(self) -> float:
        """Achievable bf16 FLOP/s."""
        return self.bf16_tflops * 1e12 * self.mfu

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Datasheet dense FLOP/s of the tensor cores for `dtype` (fp8 falls back to bf16 where it has none)."""
        return (self.fp8_tflops if dtype.startswith("fp8") and self.fp8_tflops else self.bf16_tflops) * 1e12

    def achievable_flops(self, dtype: str = "bf16") -> float:
        """Achievable FLOP/s for `dtype` on the roofline (peak x mfu)."""
        return self.peak_flops(dtype) * self.mfu

    @property
    def mem_bw(self) -> float:
        """Achievable device-memory bytes/s."""
        return self.hbm_bw_gbs * 1e9 * self.mbu

    @property
    def hbm_bytes(self) -> int:
        """Capacity in bytes (datasheet GB read as GiB, as the cards expose)."""
        return int(self.hbm_gb * GIB)


GPUS: dict[str, GPU] = {
    # NVIDIA H100 SXM5 80GB datasheet: 989.4 TFLOPS bf16 dense (1979 with sparsity), fp8 1978.9 dense, HBM3
    # 3.35 TB/s, NVLink4 900 GB/s bidirectional (450/direction). DGX/HGX H100 give each GPU
    # one 400 Gb/s ConnectX-7 NIC -> 50 GB/s per direction. Host link PCIe Gen5 x16: 64 GB/s per direction.
    "h100": GPU("h100", bf16_tflops=989.4, hbm_bw_gbs=3350.0, hbm_gb=80.0,
                nvlink_gbs=450.0, net_gbs=50.0, host_gbs=64.0, fp8_tflops=1978.9, arch="hopper"),
    # NVIDIA H200 SXM 141GB datasheet: same compute as H100 SXM (989.4 dense), HBM3e 4.8 TB/s,
    # NVLink 900 GB/s bidirectional; HGX H200 networking as HGX H100 (400 Gb/s per GPU).
    "h200": GPU("h200", bf16_tflops=989.4, hbm_bw_gbs=4800.0, hbm_gb=141.0,
                nvlink_gbs=450.0, net_gbs=50.0, host_gbs=64.0, fp8_tflops=1978.9, arch="hopper"),
    # NVIDIA H20 (China SKU, Hopper): 148 TFLOPS bf16 dense, 296 fp8 dense, HBM3 4.0 TB/s, 96 GB, NVLink
    # 900 GB/s bidirectional. Inter-node: AMPD's testbed (§7.1) has 200 GB/s InfiniBand per
    # 8-GPU server -> 25 GB/s per GPU per direction. Host link PCIe Gen5 x16.
    "h20": GPU("h20", bf16_tflops=148.0, hbm_bw_gbs=4000.0, hbm_gb=96.0,
               nvlink_gbs=450.0, net_gbs=25.0, host_gbs=64.0, fp8_tflops=296.0, arch="hopper"),
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS bf16 dense, HBM2e 2039 GB/s, NVLink3 600 GB/s
    # bidirectional (300/direction). DGX A100: one 200 Gb/s HDR NIC per GPU -> 25 GB/s.
    "a100-80g": GPU("a100-80g", bf16_tflops=312.0, hbm_bw_gbs=2039.0, hbm_gb=80.0,
                    nvlink_gbs=300.0, net_gbs=25.0, arch="ampere"),
    # NVIDIA L40S datasheet: 362.05 TFLOPS bf16 dense (733 with sparsity), fp8 733 dense, GDDR6 864 GB/s,
    # 48 GB. No NVLink: GPU<->GPU over PCIe Gen4 x16, ~32 GB/s per direction. Networking is an
    # assumption (no reference server): 100 Gb/s per GPU (e.g. 4x200GbE per 8 GPUs) -> 12.5 GB/s.
    "l40s": GPU("l40s", bf16_tflops=362.05, hbm_bw_gbs=864.0, hbm_gb=48.0,
                nvlink_gbs=32.0, net_gbs=12.5, nvlink_latency_s=PCIE_HOP_LATENCY_S,
                net_latency_s=ETH_LATENCY_S, has_nvlink=False, fp8_tflops=733.0, arch="ada"),
    # NVIDIA GeForce RTX 4090 (Ada whitepaper): 165.2 TFLOPS bf16 dense with FP32 accumulate (fp8 330.3)
    # (330.4 with sparsity), GDDR6X 1008 GB/s, 24 GB. No NVLink, PCIe Gen4 x16 ~32 GB/s per
    # direction. Networking is an assumption: 100 GbE per GPU -> 12.5 GB/s.
    "rtx4090": GPU("rtx4090", bf16_tflops=165.2, hbm_bw_gbs=1008.0, hbm_gb=24.0,
                   nvlink_gbs=32.0, net_gbs=12.5, nvlink_latency_s=PCIE_HOP_LATENCY_S,
                   net_latency_s=ETH_LATENCY_S, has_nvlink=False, fp8_tflops=330.3, arch="ada"),
}

# Other spellings people use; keys are normalised (lowercase, spaces/underscores -> '-').
_ALIASES: dict[str, str] = {
    "h100-sxm": "h100", "h100-sxm5": "h100", "h100-80g": "h100", "h100-80gb": "h100",
    "h200-sxm": "h200", "h200-141g": "h200", "h200-141gb": "h200",
    "h20-96g": "h20", "h20-96gb": "h20",
    "a100": "a100-80g", "a100-80gb": "a100-80g", "a100-sxm4-80gb": "a100-80g", "a100-sxm-80gb": "a100-80g",
    "l40s-48g": "l40s", "l40s-48gb": "l40s",
    "4090": "rtx4090", "rtx-4090": "rtx4090", "geforce-rtx-4090": "rtx4090",
}


def _norm(name: str) -> str:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return key[len("nvidia-"):] if key.startswith("nvidia-") else key


def get_gpu(name: str | GPU) -> GPU:
    """Look a GPU up by name, case-insensitively; a GPU instance is returned unchanged."""
    if isinstance(name, GPU):
        return name
    key = _norm(str(name))
    key = _ALIASES.get(key, key)
    try:
        return GPUS[key]
    except KeyError:
        raise unknown_name("GPU", name, GPUS) from None
