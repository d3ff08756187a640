"""The model's input embedding and LM head, wherever they sit: a plain transformers / custom model, or
under peft's wrapper (``get_base_model()``). One home for the lookup the chunked head, the
vocabulary-parallel layers, FSDP grouping and the export all need."""

from __future__ import annotations

from torch import nn


def base_model(model: nn.Module) -> nn.Module:
    """The model under peft's wrapper (the model itself when not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embedding, LM head) of the base model; (None, None) when it has no such accessors."""
    base = base_model(model)
    if not (hasattr(base, "get_input_embeddings") and hasattr(base, "get_output_embeddings")):
        return None, None
    return base.get_input_embeddings(), base.get_output_embeddings()


def lm_head(model: nn.Module) -> nn.Module | None:
    """The base model's LM head module (None when it exposes none)."""
    base = base_model(model)
    return base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
