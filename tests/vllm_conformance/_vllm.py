"""How every conformance module gets vLLM: skipped where it is absent, an error under the script."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_vllm() -> ModuleType:
    # vLLM picks its platform at import; without this it probes for CUDA.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("HPCRL_REQUIRE_VLLM"):  # scripts/vllm_conformance.sh: a skip would hide a failure
        return importlib.import_module("vllm")
    return pytest.importorskip("vllm", reason="vLLM is not installed here; run scripts/vllm_conformance.sh")
