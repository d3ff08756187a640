"""`[model.vlm]` of `hpcrl sft`: vision-language SFT (prime-rl's VLMConfig), and the SFT model section
that holds it (the RL trainer's model section has no `vlm`: RL on images is not supported)."""

from __future__ import annotations

import re
from typing import Annotated

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.model import TrainerModelConfig

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class VLMConfig(Section):
    vision_encoder_attr: Annotated[
        str | None,
        D(
            "Dotted attribute path of the vision encoder in the model (e.g. model.visual); unset: the "
            "model type's (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe: model.visual)."
        ),
    ] = None
    language_model_attr: Annotated[
        str | None,
        D(
            "Dotted attribute path of the language model (e.g. model.language_model); unset: the model type's."
        ),
    ] = None
    freeze_vision_encoder: Annotated[
        bool,
        D("Freeze the vision encoder: no gradients, no optimizer state (false: train it; not with LoRA)."),
    ] = True

    def __post_init__(self) -> None:
        for name in ("vision_encoder_attr", "language_model_attr"):
            v = getattr(self, name)
            if v is not None and not _DOTTED.match(v):
                raise ValueError(f"{name} = {v!r} is not a dotted attribute path (e.g. 'model.visual')")


class SFTModelConfig(TrainerModelConfig):
    """The trainer's model section plus `vlm` (hpcrl sft only)."""

    vlm: Annotated[
        VLMConfig | None,
        D(
            "Vision-language SFT ([model.vlm]): rows with image parts go through the model's image "
            "processor and its own transformers class (AutoModelForImageTextToText), one sample per "
            "micro-batch; unset: a text model."
        ),
    ] = None

    def check_vlm(self, field: str = "model") -> None:
        """[vlm] against the rest of the section: one ConfigError naming the field (validate_sft)."""
        from hpcrl.errors import ConfigError

        v = self.vlm
        if v is None:
            return
        if not v.freeze_vision_encoder and self.lora is not None:
            raise ConfigError(
                f"{field}.vlm.freeze_vision_encoder",
                "false is incompatible with [lora] (LoRA freezes every non-adapter weight, the vision "
                "encoder's too); keep it true or drop [lora]",
            )
        if self.impl == "custom":
            raise ConfigError(
                f"{field}.impl",
                "'custom' with [vlm]: hpcrl has no custom vision-language class (it trains transformers' "
                "own); set impl = 'hf' or 'auto'",
            )
        if self.ep > 1:
            raise ConfigError(
                f"{field}.ep",
                f"{self.ep} with [vlm]: expert parallelism is hpcrl's custom MoE implementation, which has "
                "no vision-language class; use ep = 1",
            )
        if self.cp > 1:
            raise ConfigError(
                f"{field}.cp", f"{self.cp} with [vlm]: context parallelism does not split images; use cp = 1"
            )
