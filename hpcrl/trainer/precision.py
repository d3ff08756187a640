"""The trainer's numeric precision: what the forward/backward computes in, what the optimizer holds
(master weights, hence AdamW state), what gradients are reduced in. Pure (dtype names, no torch), so
config validation and the --dry-run summary use the same rules as the trainer.

    model.dtype               compute dtype, and the dtype of every published policy (the weights
                              inference loads); auto: bfloat16 on GPU, float32 on CPU
    model.optimization_dtype  master weights + optimizer state (float32 default)
    model.reduce_dtype        gradient reduce-scatter across ranks (float32 default)

A compute dtype narrower than the master dtype is mixed precision: FSDP2's MixedPrecisionPolicy casts
the fp32 shards to bf16 when it gathers them for a forward, and reduces the bf16 gradients in
``reduce`` into fp32 gradient shards that the optimizer steps. The defaults give bf16-mixed on GPU and
plain fp32 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from hpcrl.config.schema import TrainerModelConfig

_BITS = {"float32": 32, "bfloat16": 16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Precision:
    compute: str  # forward/backward; also what is published to inference and exported
    master: str  # parameters the optimizer steps (and so its state)
    reduce: str  # gradient reduction across ranks

    @property
    def mixed(self) -> bool:
        return self.compute != self.master

    def describe(self) -> str:
        c, m, r = _SHORT[self.compute], _SHORT[self.master], _SHORT[self.reduce]
        if self.mixed:
            return (
                f"{c}-mixed: {c} compute over {m} master weights + optimizer state, {r} gradient reduce, "
                f"{c} policy published"
            )
        if r == c:
            return f"{c} (no mixed precision)"
        return f"{c} compute, master weights + optimizer state; {r} gradient reduce"


def resolve(
    dtype: str, optimization_dtype: str, reduce_dtype: str, on_gpu: bool, field: str = "trainer.model"
) -> Precision:
    """The trainer's precision from the three fields (``field`` prefixes error paths). Raises a one-line
    ConfigError for combinations that make no sense."""
    if dtype == "float16":
        raise ConfigError(
            f"{field}.dtype",
            "'float16' is not supported for training (it needs loss scaling); use "
            "'bfloat16' (bf16 compute over float32 master weights) or 'float32'",
        )
    for name, value in (("optimization_dtype", optimization_dtype), ("reduce_dtype", reduce_dtype)):
        if value not in _BITS:
            raise ConfigError(f"{field}.{name}", f"{value!r} is not one of 'float32', 'bfloat16'")
    if dtype == "auto":
        # bf16 on GPU; on CPU fp32, unless the master weights themselves are bf16 (computing wider
        # than the weights would only upcast them).
        compute = "bfloat16" if on_gpu or optimization_dtype == "bfloat16" else "float32"
    elif dtype in _BITS:
        compute = dtype
    else:
        raise ConfigError(f"{field}.dtype", f"{dtype!r} is not one of 'auto', 'float32', 'bfloat16'")
    if _BITS[optimization_dtype] < _BITS[compute]:
        raise ConfigError(
            f"{field}.optimization_dtype",
            f"'{optimization_dtype}' master weights under '{compute}' "
            "compute gain nothing; set optimization_dtype = 'float32' or "
            "dtype = 'bfloat16'",
        )
    if _BITS[reduce_dtype] < _BITS[compute]:
        raise ConfigError(
            f"{field}.reduce_dtype",
            f"'{reduce_dtype}' would round '{compute}' gradients only to "
            "reduce them; use 'float32' (or dtype = 'bfloat16' for bf16 compute)",
        )
    return Precision(compute=compute, master=optimization_dtype, reduce=reduce_dtype)


def of_model(model_cfg: TrainerModelConfig, on_gpu: bool, field: str = "trainer.model") -> Precision:
    """``resolve`` from a TrainerModelConfig."""
    return resolve(model_cfg.dtype, model_cfg.optimization_dtype, model_cfg.reduce_dtype, on_gpu, field)
