"""What one inference server is asked to be (ServeOptions, validated) and how it announces itself
(its socket, its address file). Shared by the server entry point (server.py) and both backends
(the embedded engine and vllm_backend.py), which is why it is not in server.py: the vLLM backend
needs it and server.py needs the vLLM backend. Imports nothing heavy.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.errors import ConfigError

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.33's MaxLoRARanks


@dataclass
class ServeOptions:
    """Everything one inference server needs; the config system maps its `inference` section onto this."""

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (the address file says which)
    backend: str = "hf"  # "hf" (embedded transformers engine) | "vllm"
    max_batch_size: int = 64
    max_model_len: int = 2048
    kv_cache_tokens: int | None = None  # hf backend: KV capacity in tokens (hpcrl.inference.kv_budget)
    dtype: str = "auto"
    seed: int = 0
    run_dir: str | None = None
    server_index: int = 0
    served_model_name: str | None = None  # name clients send as `model` (default: model_name)
    device: str | None = None  # hf backend: "cpu" / "cuda" (default: cuda when available)
    log_level: str = "warning"  # uvicorn access/error log level
    trust_remote_code: bool = False  # run model code shipped in the model directory
    # vllm backend only:
    tp: int = 1  # tensor-parallel GPUs of this server (inference.parallel.tp)
    lora_rank: int | None = None  # model.lora.rank when LoRA is trained: vLLM starts with LoRA enabled
    gpu_memory_utilization: float | None = None  # None: vLLM's default
    enforce_eager: bool = False
    # inference.quantization: vLLM's --quantization; the hf engine emulates the FP8 ones (hpcrl.inference.fp8)
    quantization: str | None = None
    vllm_args: list[str] = field(default_factory=list)  # extra `vllm serve` flags
    # [inference.vllm] and the prime-rl keys that become engine arguments (hpcrl.inference.vllm_args)
    engine_args: dict[str, Any] = field(default_factory=dict)
    engine_env: dict[str, str] = field(default_factory=dict)  # exported before vLLM loads (use_deep_gemm)
    # vllm: every worker keeps the full weights it loaded (host memory from a path) as the base of
    # delta syncs; off, a worker holds one tensor at a time while loading and refuses deltas (409)
    delta_base: bool = False
    api_key: str | None = None  # bearer token for every route but /health (guard.py); None: $HPCRL_API_KEY
    allow_open: bool = False  # serve a non-loopback address without a key
    allow_any_weights_path: bool = False  # weight/LoRA loads outside run_dir
    control_timeout_s: float = 8.0  # how long /init_broadcaster waits on its peer (server.control_timeout_s)
    watchdog_s: float = 0.0  # hf backend: an engine loop without progress this long ends the server (0 = off)

    def validate(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ConfigError("inference.backend", f"{self.backend!r} is not allowed; use hf or vllm")
        if not 0 <= self.port <= 65535:
            raise ConfigError("server.port", f"{self.port} is outside 0..65535")
        if self.max_batch_size < 1:
            raise ConfigError("inference.max_batch_size", f"must be >= 1, got {self.max_batch_size}")
        if self.max_model_len < 2:
            raise ConfigError("inference.max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.backend == "hf":
            from hpcrl.inference.kv_budget import capacity

            capacity(self.kv_cache_tokens, self.max_batch_size, self.max_model_len)  # one line if too small
        if self.tp < 1:
            raise ConfigError("inference.parallel.tp", f"must be >= 1, got {self.tp}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ConfigError("model.lora.rank", f"must be >= 1, got {self.lora_rank}")
        if self.backend == "vllm" and self.lora_rank is not None:
            vllm_lora_rank(self.lora_rank)
        if not 0 < self.control_timeout_s <= 3600:
            raise ConfigError(
                "server.control_timeout_s", f"must be in (0, 3600], got {self.control_timeout_s}"
            )
        if self.api_key is not None and (not self.api_key.strip() or any(c.isspace() for c in self.api_key)):
            raise ConfigError("server.api_key", "must be a non-empty token without spaces")
        from hpcrl.inference.guard import check_exposure

        check_exposure(self.host, self.api_key, self.allow_open)


def advertised_host(host: str) -> str:
    """The host other nodes should dial: the machine's name when bound to every interface."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


_PARALLEL_FLAGS = {"--tensor-parallel-size": "tp", "-tp": "tp", "--pipeline-parallel-size": "pp", "-pp": "pp"}


def weight_receivers(
    backend: str, vllm_args: Sequence[str], tp: int = 1, engine_args: Mapping[str, Any] | None = None
) -> int:
    """How many processes of this server join the weight group (rendezvous.group_layout).

    The hf engine receives in its one process, however many GPUs it spans. vLLM starts one worker
    per tensor- x pipeline-parallel rank and each loads its own shard, so each one receives. `tp` is
    the size hpcrl renders; flags in `vllm_args` come after it on vLLM's command line, so they win
    (and the last one of them, as in argparse)."""
    if backend != "vllm":
        return 1
    sizes = {"tp": tp, "pp": 1}
    if engine_args and engine_args.get("pipeline_parallel_size") is not None:  # [inference.vllm]
        try:
            sizes["pp"] = int(engine_args["pipeline_parallel_size"])
        except (TypeError, ValueError):
            raise ConfigError(
                "inference.vllm.pipeline_parallel_size",
                f"needs an integer, got {engine_args['pipeline_parallel_size']!r}",
            ) from None
    args = list(vllm_args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag.startswith("--"):
            flag = flag.replace("_", "-")  # vLLM's parser accepts --tensor_parallel_size too
        if flag not in _PARALLEL_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            sizes[_PARALLEL_FLAGS[flag]] = int(value)
        except ValueError:
            raise ConfigError("inference", f"{flag} needs an integer, got {value!r}") from None
    if min(sizes.values()) < 1:
        raise ConfigError("inference", f"parallel sizes must be >= 1, got tp={sizes['tp']} pp={sizes['pp']}")
    return sizes["tp"] * sizes["pp"]


def write_server_info(opts: ServeOptions, port: int) -> Path | None:
    """Write the ready file atomically (tmp + fsync + rename); the bus ServerInfo when it exists."""
    if not opts.run_dir:
        return None
    from hpcrl.paths import RunPaths

    host = advertised_host(opts.host)
    info = {
        "index": opts.server_index,
        "base_url": f"http://{host}:{port}",
        "host": host,
        "port": port,
        "pid": os.getpid(),
        "model": opts.served_model_name or opts.model_name,
        "weight_receivers": weight_receivers(opts.backend, opts.vllm_args, opts.tp, opts.engine_args),
    }
    paths = RunPaths(opts.run_dir)
    paths.servers_dir.mkdir(parents=True, exist_ok=True)
    # The bus owns the format (ServerInfo as JSON, what Bus.servers() reads) and rings the waiters.
    from hpcrl.bus.api import announce_server
    from hpcrl.bus.messages import ServerInfo, SlurmTask

    info["slurm"] = SlurmTask.from_env(os.environ)  # how the orchestrator ends it if it freezes

    path = announce_server(paths, ServerInfo(**info))
    from hpcrl.runtime import record

    record(paths, "inference", opts.server_index, port)
    return path


def vllm_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that fits a LoRA of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(
        "model.lora.rank", f"{rank} is above {VLLM_LORA_RANKS[-1]}, the largest LoRA rank vLLM serves"
    )


def bind_server_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) the server's socket; port 0 picks a free one (getsockname says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not the default 0: asyncio turns Nagle off only on TCP sockets whose proto
    # says so, and with Nagle on a kept-alive connection's every response after the first waits ~40 ms
    # for the client's delayed ACK (uvicorn writes head and body separately). TCP_NODELAY on the
    # listener as well: Linux copies it to every accepted connection, whoever serves them (uvicorn
    # here, vLLM's server with the vLLM backend).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError("server.port", f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock
