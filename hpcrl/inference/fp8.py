"""FP8 rollout: what `inference.quantization` means for memory, and the embedded engine's emulation.

prime-rl #3031 added `inference.quantization = "fp8_per_block" | "mxfp8"`, vLLM 0.33's own online
quantization shorthands (vllm/config/quantization.py): vLLM loads the bf16 policy and quantizes its
linear layers as it loads them, and each weight update (still bf16) is reloaded layer by layer and
re-quantized (hpcrl.inference.vllm_worker; prime-rl #3581 removed the path where the trainer sent FP8).

vLLM's FP8 GEMMs need a GPU. On CPU the embedded engine *emulates* the scheme: every quantized weight
is quantized to float8_e4m3fn and dequantized back (`fake_quant`), at load and after each update, so
the sampler really samples from the FP8 policy and the trainer/sampler mismatch is the one FP8 makes
(the activations stay in the compute dtype: vLLM's block scheme also quantizes them per token group,
which this leaves out).

Schemes (`SCHEMES`): block shape over a matrix's (rows, cols) and whether scales are powers of two:
- fp8_per_block: 128 x 128 blocks, fp32 scale amax / 448 (DeepSeek-V3's recipe, vLLM's
  kFp8Static128BlockSym);
- mxfp8: 1 x 32 blocks along the input dimension, E8M0 (power-of-two) scales, rounded up (the
  "rceil" recipe) so no element saturates;
- fp8 / fp8_per_tensor: one scale per tensor; fp8_per_channel: one per output row.
Other vLLM quantization methods (checkpoint formats: awq, gptq, ...) are not emulated: the embedded
engine serves the weights as loaded, and says so.

Pure functions; torch is imported inside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-4  # vLLM's / DeepSeek's floor on a block's amax (an all-zero block gets scale 1e-4 / 448)


@dataclass(frozen=True)
class Scheme:
    block: tuple[int | None, int | None]  # (rows, cols) of one scale block; None = the whole dimension
    pow2: bool  # scales are powers of two (E8M0)
    scale_bytes: int  # bytes of one stored scale (fp32 = 4, E8M0 = 1)


SCHEMES: dict[str, Scheme] = {
    "fp8_per_block": Scheme((128, 128), False, 4),
    "mxfp8": Scheme((1, 32), True, 1),
    "fp8": Scheme((None, None), False, 4),
    "fp8_per_tensor": Scheme((None, None), False, 4),
    "fp8_per_channel": Scheme((1, None), False, 4),
}


def scheme(quantization: str | None) -> Scheme | None:
    """The FP8 scheme of an `inference.quantization` value; None when unset or not an FP8 scheme."""
    return None if quantization is None else SCHEMES.get(quantization)


def weight_bytes_per_param(quantization: str | None, dtype_bytes: float) -> float:
    """Served bytes per parameter of a quantized linear weight: 1 (FP8) + its share of one scale per
    block (fp8_per_block: 4 / 16384; mxfp8: 1 / 32); `dtype_bytes` when the scheme is not FP8. Per-tensor
    and per-channel scales are negligible (counted as 0)."""
    s = scheme(quantization)
    if s is None:
        return dtype_bytes
    rows, cols = s.block
    if rows is None or cols is None:
        return 1.0
    return 1.0 + s.scale_bytes / (rows * cols)


def block_scales(w: torch.Tensor, block: tuple[int | None, int | None], pow2: bool = False) -> torch.Tensor:
    """One scale per block of the last two dims of `w` (shape [..., ceil(R/br), ceil(C/bc)]): block amax
    (floored at MIN_AMAX) / 448, or with `pow2` the next power of two above it. Edge blocks smaller than
    the block shape take the amax of the elements they have."""
    import torch

    x = w.detach().float()
    rows, cols = x.shape[-2], x.shape[-1]
    br, bc = block[0] or rows, block[1] or cols
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.nn.functional.pad(x.abs(), (0, nc * bc - cols, 0, nr * br - rows))  # zeros: amax-neutral
    amax = padded.reshape(*x.shape[:-2], nr, br, nc, bc).amax(dim=(-3, -1)).clamp(min=MIN_AMAX)
    scale = amax / E4M3_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def fake_quant(
    w: torch.Tensor, block: tuple[int | None, int | None] = (128, 128), pow2: bool = False
) -> torch.Tensor:
    """Quantize `w` to float8_e4m3fn with one scale per block of its last two dims, and dequantize: the
    values an FP8 engine computes with, in `w`'s dtype and shape. |error| <= 2^-4 |x| + scale * 2^-9 per
    element (E4M3 keeps 3 mantissa bits; 2^-9 is its smallest subnormal step)."""
    import torch

    if w.dim() < 2:
        raise ValueError(f"fake_quant needs a matrix (or a stack of them), got shape {tuple(w.shape)}")
    x = w.detach().float()
    rows, cols = x.shape[-2], x.shape[-1]
    br, bc = block[0] or rows, block[1] or cols
    scale = block_scales(x, block, pow2)
    full = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :rows, :cols]
    q = (x / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * full).to(w.dtype)


def quantized_names(params: dict[str, torch.Tensor]) -> list[str]:
    """The parameters vLLM's online FP8 quantizes: weights of linear layers and MoE experts (2-D or
    stacked 3-D); embeddings, the LM head, norms, biases and MoE routers (prime-rl's ignore_patterns:
    router, mlp.gate., shared_expert_gate) stay in the model dtype."""
    skip = ("embed", "lm_head", "norm", "router", "mlp.gate.", "shared_expert_gate")
    return [
        n
        for n, p in params.items()
        if p.dim() >= 2 and p.is_floating_point() and not any(s in n for s in skip)
    ]


def fake_quant_params(params: dict[str, torch.Tensor], quantization: str | None) -> int:
    """Emulate `quantization` on the served parameters in place (each tensor once, aliases skipped);
    returns how many tensors changed (0 when the scheme is not an FP8 one)."""
    import torch

    s = scheme(quantization)
    if s is None:
        return 0
    done: set[int] = set()
    with torch.no_grad():
        for name in quantized_names(params):
            p = params[name]
            key = p.data_ptr()
            if key in done:
                continue
            done.add(key)
            p.copy_(fake_quant(p, s.block, s.pow2))
    return len(done)
