"""`perf/throughput_per_gpu` and `perf/mfu` (seed 001's performance metrics), both trainers.

MFU = achieved model FLOP/s / peak FLOP/s of the devices. Achieved: 6 x parameters x trained tokens/s
(forward + backward of a dense model; attention's quadratic term and MoE sparsity are not counted,
so an MoE model's MFU reads high by its total/active parameter ratio). Peak: the configured figure
(`peak_tflops`), else the dense bf16 peak of the GPU by its name; on CPU without a figure there is no
`perf/mfu` at all rather than a made-up one.
"""

from __future__ import annotations

from functools import cache

import torch

# Dense bf16 tensor-core peak per GPU in TFLOP/s (vendor data sheets, without sparsity), matched
# against torch.cuda.get_device_name() in this order (the first substring that matches wins).
GPU_PEAK_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
    ("MI300X", 1307.0),
)


def gpu_peak_tflops(name: str) -> float | None:
    """The table's figure for a device name, or None for a GPU it does not know."""
    for key, tflops in GPU_PEAK_TFLOPS:
        if key.lower() in name.lower():
            return tflops
    return None


@cache
def device_peak_tflops(configured: float | None) -> float | None:
    if configured is not None:
        return configured
    if torch.cuda.is_available():
        return gpu_peak_tflops(torch.cuda.get_device_name())
    return None


def count_params(model: torch.nn.Module) -> int:
    """Every parameter of the model (FSDP's DTensor reports its global size)."""
    return sum(p.numel() for p in model.parameters())


def perf_metrics(
    tokens_per_s: float, world_size: int, num_params: int, peak_tflops: float | None
) -> dict[str, float]:
    """Throughput per device (GPU, or trainer rank on CPU) and, with a known peak, MFU."""
    per_gpu = tokens_per_s / max(world_size, 1)
    out = {"perf/throughput_per_gpu": per_gpu}
    peak = device_peak_tflops(peak_tflops)
    if peak:
        out["perf/mfu"] = 6.0 * num_params * per_gpu / (peak * 1e12)
    return out
