"""Every piece of vLLM hpcrl touches, resolved in one place: the modules each name may live in (newest
layout first), the engine-client methods and app/worker attributes the routes and the worker extension
use. The conformance tests (tests/vllm_conformance/) check these tables against vLLM 0.33's real
modules on CPU; `vllm_symbol` gives a one-line ConfigError when a name is missing. Nothing here imports
vllm until a symbol is asked for.
"""

import importlib
from functools import cache
from typing import Any

SUPPORTED_VLLM = "0.33"

# Every vLLM import hpcrl makes: name -> modules that define it, newest layout first. The backend
# resolves them at start and the conformance tests check them against the real vLLM.
VLLM_SYMBOLS: dict[str, tuple[str, ...]] = {
    "make_arg_parser": ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args"),
    "validate_parsed_serve_args": ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args"),
    "validate_api_server_args": ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.api_server"),
    "FlexibleArgumentParser": ("vllm.utils.argparse_utils", "vllm.utils"),
    # build_app is patched in the module this function comes from (see _install_routes).
    "run_server_worker": (
        "vllm.entrypoints.launchers.api_server.entry",
        "vllm.entrypoints.openai.api_server",
    ),
    "LoadLoRAAdapterRequest": ("vllm.entrypoints.serve.lora.protocol", "vllm.entrypoints.openai.protocol"),
    "ErrorResponse": ("vllm.entrypoints.serve.engine.protocol", "vllm.entrypoints.openai.protocol"),
    # weight updates of a quantized model (hpcrl.inference.vllm_worker.layerwise_reload)
    "set_current_vllm_config": ("vllm.config",),
    "initialize_layerwise_reload": ("vllm.model_executor.model_loader.reload",),
    "finalize_layerwise_reload": ("vllm.model_executor.model_loader.reload",),
    # the values --quantization takes (its parser takes any text; ModelConfig refuses the rest at start)
    "QUANTIZATION_METHODS": ("vllm.model_executor.layers.quantization",),
}
# Methods of app.state.engine_client the routes call, with the keyword arguments they pass.
ENGINE_CLIENT_METHODS: dict[str, tuple[str, ...]] = {
    "collective_rpc": ("args",),
    "reset_prefix_cache": (),
    "pause_generation": ("mode", "clear_cache"),
    "resume_generation": (),
}
APP_STATE = ("engine_client", "openai_serving_models")  # attributes of app.state the routes read
# attributes of vLLM's worker the extension reads
WORKER_ATTRS = ("rank", "device", "model_runner", "model_config", "vllm_config")


def _not_available(message: str) -> Exception:
    from hpcrl.errors import ConfigError

    return ConfigError("inference.backend", message)


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when vllm is not installed."""
    import importlib.metadata
    import importlib.util

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown" if importlib.util.find_spec("vllm") is not None else None


def _missing_module(e: ModuleNotFoundError, module: str) -> bool:
    """True when `module` itself (or a package above it) does not exist, not one of its imports."""
    return bool(e.name) and (module == e.name or module.startswith(e.name + "."))


@cache
def vllm_symbol(name: str) -> Any:
    """Import one of VLLM_SYMBOLS; a one-line ConfigError that says what is missing and from which vLLM."""
    version = vllm_version()
    if version is None:
        raise _not_available(
            "vllm is not installed; `pip install 'hpcrl[gpu]'` on a GPU machine or use --inference.backend hf"
        )
    modules = VLLM_SYMBOLS[name]
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if _missing_module(e, module_name):
                continue
            raise _not_available(
                f"vllm {version} is installed but importing {module_name} failed: {e}; "
                "install the packages vllm requires"
            ) from e
        except Exception as e:  # a broken install: CUDA libraries, an incompatible torch, ...
            raise _not_available(
                f"vllm {version} is installed but importing {module_name} failed: {type(e).__name__}: {e}"
            ) from e
        if hasattr(module, name):
            return getattr(module, name)
    raise _not_available(
        f"vllm {version} is installed but has no {name} (looked in {', '.join(modules)}); "
        f"hpcrl's vllm backend supports vLLM {SUPPORTED_VLLM}"
    )
