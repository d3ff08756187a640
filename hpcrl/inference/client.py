"""Async HTTP client of an hpcrl inference server (either backend), for the orchestrator and trainer.

    async with InferenceClient("http://127.0.0.1:8000") as c:
        await c.wait_healthy()
        r = await c.chat_completion(messages, n=8, max_tokens=64)        # token ids + logprobs included
        await c.update_weights(5, path=".../weights/step_5", expected_checksum=ck)  # WeightSyncError if not

Every non-2xx answer raises `InferenceError` with the server's message; a weight update whose loaded
checksum differs from the expected one raises `WeightSyncError` — never a silently stale server.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


class InferenceError(RuntimeError):
    """The server answered with an error (status, OpenAI-style type and message)."""

    def __init__(self, status: int, type: str, message: str, url: str):
        super().__init__(f"{url}: HTTP {status} {type}: {message}")
        self.status, self.type, self.message, self.url = status, type, message, url


class WeightSyncError(InferenceError):
    """A weight update did not land as expected (wrong checksum, wrong step, or the load failed)."""


class InferenceClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        api_key: str | None = None,
        max_connections: int = 1024,
    ):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=10.0),
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    @property
    def openai_base_url(self) -> str:
        """What to give `openai.AsyncOpenAI(base_url=...)`."""
        return f"{self.base_url}/v1"

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(
        self, method: str, path: str, json: Any = None, error_cls: type[InferenceError] = InferenceError
    ) -> Any:
        r = await self._http.request(method, path, json=json)
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                etype, msg = str(err.get("type")), str(err.get("message"))
            except Exception:
                etype, msg = "HTTPError", r.text[:500]
            raise error_cls(r.status_code, etype, msg, f"{self.base_url}{path}")
        return r.json()

    # -- status ----------------------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health")

    async def wait_healthy(self, timeout: float = 120.0, interval: float = 0.2) -> dict[str, Any]:
        """Poll /health until the server answers (it is loading the model before that)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                return await self.health()
            except (httpx.TransportError, InferenceError) as e:
                last = e
            await asyncio.sleep(interval)
        raise TimeoutError(f"inference server {self.base_url} not healthy after {timeout:.0f}s: {last}")

    async def models(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/models"))["data"]

    async def stats(self) -> dict[str, Any]:
        """The embedded engine's counters (JSON)."""
        return await self._request("GET", "/stats")

    async def metrics_text(self) -> str:
        """/metrics in Prometheus text (both backends; read by hpcrl.orchestrator.concurrency)."""
        r = await self._http.get("/metrics")
        r.raise_for_status()
        return r.text

    async def weights(self) -> dict[str, Any]:
        """The loaded policy step and the checksum of the loaded weights."""
        return await self._request("GET", "/weights")

    # -- generation ------------------------------------------------------------------------------------
    async def chat_completion(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str | None = None,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        tokens: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        """POST /v1/chat/completions. tokens=True asks for prompt/completion token ids and logprobs."""
        body: dict[str, Any] = {"messages": messages, "n": n, "temperature": temperature, **sampling}
        if model is not None:
            body["model"] = model
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if tools:
            body["tools"] = tools
        if tokens:
            body.update(logprobs=True, return_token_ids=True)
        return await self._request("POST", "/v1/chat/completions", body)

    async def completion(
        self,
        prompt: str | list[int],
        *,
        model: str | None = None,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        tokens: bool = True,
        **sampling: Any,
    ) -> dict[str, Any]:
        """POST /v1/completions; `prompt` may be token ids (exact continuation for multi-turn stitching)."""
        body: dict[str, Any] = {"prompt": prompt, "n": n, "temperature": temperature, **sampling}
        if model is not None:
            body["model"] = model
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if tokens:
            body.update(logprobs=0, return_token_ids=True)
        return await self._request("POST", "/v1/completions", body)

    async def generate(
        self, token_ids: list[int], *, model: str | None = None, sampling_params: dict[str, Any]
    ) -> dict[str, Any]:
        """POST /inference/v1/generate (vLLM's token-in/token-out route): the prompt is these ids."""
        body: dict[str, Any] = {"token_ids": token_ids, "sampling_params": sampling_params}
        if model is not None:
            body["model"] = model
        return await self._request("POST", "/inference/v1/generate", body)

    async def tokenize(
        self,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        body: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
        if messages is not None:
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        if tools:
            body["tools"] = tools
        return (await self._request("POST", "/tokenize", body))["tokens"]

    # -- admin -----------------------------------------------------------------------------------------
    async def pause(self) -> dict[str, Any]:
        return await self._request("POST", "/pause")

    async def resume(self) -> dict[str, Any]:
        return await self._request("POST", "/resume")

    async def init_broadcaster(
        self,
        host: str,
        port: int,
        world_size: int,
        rank: int,
        timeout: float = 300.0,
        receivers: int | None = None,
        join_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Join the trainer's weight-broadcast group (returns once every rank joined).

        `rank` is this server's rank offset: its workers join as rank, rank + 1, ... `receivers`
        (what the server announced) lets the server refuse at once if it runs another number of
        receiving workers, instead of the group timing out. `join_timeout` bounds the join (default:
        the server's server.control_timeout_s; 502/504 naming the address when it does not complete)."""
        body: dict[str, Any] = {
            "host": host,
            "port": port,
            "world_size": world_size,
            "rank": rank,
            "timeout": timeout,
        }
        if receivers is not None:
            body["receivers"] = receivers
        if join_timeout is not None:
            body["join_timeout"] = join_timeout
        return await self._request("POST", "/init_broadcaster", body)

    async def update_weights(
        self,
        step: int,
        *,
        path: str | None = None,
        collective: bool = False,
        expected_checksum: str | None = None,
    ) -> dict[str, Any]:
        """Load policy `step` from `path` or from the broadcast group; verify the loaded checksum.

        Raises WeightSyncError when the server fails to load or reports another checksum or step.
        """
        if (path is None) == (not collective):
            raise ValueError("give exactly one of path=... or collective=True")
        body: dict[str, Any] = {"step": step}
        if collective:
            body["transport"] = "collective"
        else:
            body["path"] = path
        if expected_checksum is not None:
            body["expected_checksum"] = expected_checksum
        r = await self._request("POST", "/update_weights", body, error_cls=WeightSyncError)
        url = f"{self.base_url}/update_weights"
        if r.get("step") != step:
            raise WeightSyncError(
                200, "WeightSyncError", f"server loaded step {r.get('step')}, not {step}", url
            )
        if expected_checksum is not None and r.get("checksum") != expected_checksum:
            raise WeightSyncError(
                200,
                "WeightSyncError",
                f"server loaded checksum {r.get('checksum')}, expected {expected_checksum}",
                url,
            )
        return r

    async def load_lora_adapter(self, name: str, path: str, step: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if step is not None:  # hpcrl's servers tag what they generate with this policy step
            body["step"] = step
        return await self._request("POST", "/load_lora_adapter", body, error_cls=WeightSyncError)
