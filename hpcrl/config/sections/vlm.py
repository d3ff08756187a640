"""The SFT model section and the `[model.vlm]` checks shared by `hpcrl sft` and `hpcrl run` (the
section itself, prime-rl's VLMConfig, is hpcrl.config.sections.model.VLMConfig: RL's model has it too)."""

from __future__ import annotations

from typing import Annotated

from hpcrl.config.sections.base import D
from hpcrl.config.sections.model import TrainerModelConfig, VLMConfig


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
        if self.lora is not None and list(self.lora.target_modules) == ["experts"]:  # hpcrl.models.vlm_moe
            raise ConfigError(
                f"{field}.lora.target_modules",
                "['experts'] alone with [vlm]: the stacked experts' LoRA rides beside peft's adapters; "
                "add a projection (e.g. 'q_proj')",
            )
        if self.cp > 1:
            raise ConfigError(
                f"{field}.cp", f"{self.cp} with [vlm]: context parallelism does not split images; use cp = 1"
            )
