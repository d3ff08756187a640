"""hpcrl's own Qwen3 dense / Qwen3-MoE training implementation (``trainer.model.impl = "custom"``)."""

from hpcrl.models.qwen3.model import Qwen3ForTraining
from hpcrl.models.qwen3.state_dict_adapter import from_hf, to_hf

MODEL_TYPES = ("qwen3", "qwen3_moe")
build = Qwen3ForTraining

__all__ = ["MODEL_TYPES", "Qwen3ForTraining", "build", "from_hf", "to_hf"]
