"""The Qwen3 / Qwen3-MoE family's construction path (:class:`hpcrl.models.spec.ModelSpec`): hpcrl's own
module (:mod:`.model`), expert parallelism (:mod:`.parallelize`), the state-dict adapter
(:mod:`.state_dict_adapter`) and the config check (:mod:`.args`)."""

from __future__ import annotations

from typing import Any

from hpcrl.models.custom import build_custom
from hpcrl.models.qwen3.args import unsupported
from hpcrl.models.spec import ModelSpec


def _apply_ep(*args: Any, **kwargs: Any) -> set:
    from hpcrl.models.qwen3.parallelize import apply_ep

    return apply_ep(*args, **kwargs)


def _from_hf(state: dict) -> dict:
    from hpcrl.models.qwen3.state_dict_adapter import from_hf

    return from_hf(state)


def _to_hf(named: Any) -> Any:
    from hpcrl.models.qwen3.state_dict_adapter import to_hf

    return to_hf(named)


SPEC = ModelSpec(
    name="qwen3",
    model_types=("qwen3", "qwen3_moe"),
    build=build_custom,
    apply_ep=_apply_ep,
    from_hf=_from_hf,
    to_hf=_to_hf,
    unsupported=unsupported,
)
