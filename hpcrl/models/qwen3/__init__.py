"""hpcrl's own Qwen3 dense / Qwen3-MoE training implementation (``trainer.model.impl = "custom"``).

The model and its state-dict adapter import torch when first asked for; ``unsupported`` (the
config check the --dry-run runs) does not."""

from typing import Any

from hpcrl.models.qwen3.args import unsupported

MODEL_TYPES = ("qwen3", "qwen3_moe")

__all__ = ["MODEL_TYPES", "SPEC", "Qwen3ForTraining", "apply_ep", "build", "from_hf", "to_hf", "unsupported"]


def __getattr__(name: str) -> Any:
    if name in ("Qwen3ForTraining", "build"):
        from hpcrl.models.qwen3.model import Qwen3ForTraining

        return Qwen3ForTraining
    if name in ("from_hf", "to_hf"):
        from hpcrl.models.qwen3 import state_dict_adapter

        return getattr(state_dict_adapter, name)
    if name == "SPEC":  # the family's construction path (hpcrl.models.spec)
        from hpcrl.models.qwen3.spec import SPEC

        return SPEC
    if name == "apply_ep":
        from hpcrl.models.qwen3.parallelize import apply_ep

        return apply_ep
    raise AttributeError(name)
