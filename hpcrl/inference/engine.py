"""Embedded inference engine: a transformers model behind a continuous-batching scheduler thread.

One thread owns the model. Every iteration it (1) admits waiting sequences up to `max_batch_size` by
prefilling them together and splicing their KV cache into the running batch (left-padded, aligned on
the right), (2) samples one token for every running row from logits computed in the previous forward,
(3) retires finished rows, and (4) runs one batched decode forward for the rest. A request that arrives
while others decode joins at the next iteration instead of waiting for the batch to drain.

Weight updates take the same lock as an iteration, so they land between decode steps. A request with
images (hpcrl.inference.vision) keeps its own KV cache and steps once per iteration beside the batch. Each token
records the policy step of the weights whose forward produced its logits; a response lists them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcrl.errors import ConfigError
from hpcrl.inference import kv_budget, routing
from hpcrl.inference.batch import DecodeBatch
from hpcrl.inference.engine_weights import EngineWeights
from hpcrl.inference.errors import EngineFailed, InvalidRequest, ShuttingDown
from hpcrl.inference.fp8 import fake_quant_params
from hpcrl.inference.loading import (
    lora_deltas,
    read_adapter,
)
from hpcrl.inference.protocol import SamplingParams, SeqOutput
from hpcrl.inference.routing import RoutingRecorder
from hpcrl.inference.sampling import BatchParams, RowParams, processed_logprobs, sample
from hpcrl.inference.tokens import Tokens
from hpcrl.inference.vision import VisionServing, vision_model_class
from hpcrl.models.chunked import prompt_logprobs
from hpcrl.models.qwen3.state_dict_adapter import hf_views
from hpcrl.weights.checksum import state_dict_checksum

log = logging.getLogger("hpcrl.inference.engine")

IDLE_BEAT_S = 1.0  # an idle engine still beats the watchdog this often (hpcrl.monitor.watchdog)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    future: Future
    seqs: list[_Seq] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)
    prompt_routed: torch.Tensor | None = None  # MoE: [prompt tokens, layers, k] from the prefill
    mm: dict[str, torch.Tensor] | None = None  # images: pixel_values, image_grid_thw (hpcrl.inference.vision)


@dataclass(eq=False)
class _Seq:
    req: _Request
    row: RowParams
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)  # MoE: [layers, k] per fed-back sampled token
    logits_step: int = 0  # policy step of the forward that produced this row's pending logits
    finish: str | None = None
    stop_reason: str | int | None = None


def _check_cache_layers(config: Any) -> None:
    """The decode batch keeps a full-attention KV slab; sliding-window or linear-attention layers
    (whose caches drop or summarise tokens) need vLLM."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache(config=config)
    kinds = {type(layer) for layer in cache.layers} | ({cache.layer_class_to_replicate} - {None})
    if kinds - {DynamicLayer}:
        names = ", ".join(sorted(k.__name__ for k in kinds - {DynamicLayer}))
        raise ValueError(
            f"model.name: the hf backend serves full-attention models only (this one has {names} "
            "cache layers); use --inference.backend vllm"
        )


class HFEngine(EngineWeights, VisionServing):
    """Serve one causal LM with batched sampling, live weight updates and per-token policy steps."""

    def __init__(
        self,
        model_path: str,
        *,
        max_batch_size: int = 64,
        max_model_len: int = 2048,
        dtype: str = "auto",
        seed: int = 0,
        device: str | None = None,
        trust_remote_code: bool = False,
        quantization: str | None = None,
        kv_cache_tokens: int | None = None,
    ):
        from transformers import AutoConfig

        from hpcrl.models.tokenizer import load_tokenizer

        if device is None:
            from hpcrl.runtime import use_cuda

            device = "cuda" if use_cuda() else "cpu"
        self.device = torch.device(device)
        if dtype not in ("auto", *_DTYPES):
            raise ConfigError("model.dtype", f"must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        kwargs: dict[str, Any] = {"attn_implementation": "sdpa", "trust_remote_code": trust_remote_code}
        if dtype != "auto":
            kwargs["dtype"] = _DTYPES[dtype]
        try:
            self.tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
            auto = vision_model_class(
                AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            )
            self.model = auto.from_pretrained(model_path, **kwargs).to(self.device).eval()
        except (OSError, ValueError) as e:  # a user error (wrong path / hub id offline): one line, exit 2
            raise ConfigError("model.name", f"cannot load {model_path!r}: {str(e).splitlines()[0]}") from e
        cfg = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.max_model_len = min(
            int(max_model_len), int(getattr(cfg, "max_position_embeddings", max_model_len))
        )
        self.max_batch_size = int(max_batch_size)
        # KV capacity in tokens (hpcrl.inference.kv_budget): exceeded, requests queue and the youngest
        # running ones are preempted
        self.kv_capacity = kv_budget.capacity(kv_cache_tokens, self.max_batch_size, self.max_model_len)
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.tokens = Tokens(self.tokenizer)  # thread-safe encode/decode with the prompt and token caches
        self._init_vision(model_path, trust_remote_code)  # a vision-language model: requests with images
        eos = {self.tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = {int(e) for e in eos if e is not None}
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._weights_lock = threading.Lock()  # held by each iteration and by each weight swap
        self._update_lock = threading.Lock()  # one update at a time (checksum computed outside _weights_lock)
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        _check_cache_layers(self.model.config)
        self._batch = DecodeBatch(self.model, self.max_batch_size, self.device)
        self._routing = RoutingRecorder(self.model)  # MoE: experts each sampled token was routed to
        self._bparams: BatchParams | None = None  # the running rows' sampling tensors
        self._cancelled = False  # a future was cancelled: look for its rows at the next iteration
        self._paused = False
        self._stopping = False
        self.policy_step = 0
        # Parameters by name, tied aliases included, so an update may name either alias.
        # MoE: fused experts appear as per-expert views under the checkpoint names the trainer publishes.
        self._params = hf_views(dict(self.model.state_dict(keep_vars=False)))
        self._weight_names = self._unique_param_names()
        self.checksum = state_dict_checksum({n: self._params[n] for n in self._weight_names})
        self.quantization = quantization  # FP8 emulated after every load, checksum taken before (fp8.py)
        fake_quant_params(self._params, quantization)
        self._lora_base: dict[str, torch.Tensor] = {}
        self.lora_adapters: dict[str, str] = {}  # name -> where it came from (its dir, or "broadcast:step_N")
        self.lora_checksum: str | None = None  # checksum of the merged adapter's tensors
        self.stats: dict[str, Any] = {
            "requests": 0,
            "forward_steps": 0,
            "prefills": 0,
            "generated_tokens": 0,
            "batch_size_hist": collections.Counter(),
            "max_batch_size_seen": 0,
            "engine_errors": 0,
            "preemptions": 0,
        }
        self._thread = threading.Thread(target=self._loop, name="hpcrl-engine", daemon=True)
        self._thread.start()

    def _unique_param_names(self) -> list[str]:
        """State-dict names with tied aliases dropped (first name wins), as save_pretrained writes them."""
        seen, names = set(), []
        for name, t in self._params.items():
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key not in seen:
                seen.add(key)
                names.append(name)
        return names

    # -- requests --------------------------------------------------------------------------------------
    def submit(
        self, prompt: list[int], params: SamplingParams, mm: dict[str, torch.Tensor] | None = None
    ) -> Future:
        """Queue `params.n` samples continuing `prompt` (with `mm`: its images, vision_prompt's); the
        future resolves to list[SeqOutput]."""
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        room = self.max_model_len - len(prompt)
        if room <= 0:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(prompt)} tokens",
                param="prompt",
            )
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequest(f"stop token ids must be in [0, {self.vocab_size})", param="stop_token_ids")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + params.max_tokens} tokens ({len(prompt)} in the "
                f"prompt, {params.max_tokens} for the completion)",
                param="max_tokens",
            )
        if mm is not None and params.n > self.max_batch_size:  # its rows share one cache: they run together
            raise InvalidRequest(
                f"a request with images runs its n rows together; n = {params.n} exceeds the engine's "
                f"max_batch_size {self.max_batch_size}",
                param="n",
            )
        fut: Future = Future()
        req = _Request(
            prompt=list(prompt), params=params, max_tokens=params.max_tokens or room, future=fut, mm=mm
        )
        for i in range(params.n):
            gen = None
            if params.seed is not None:  # choice i of a seeded request draws from seed + i
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            req.seqs.append(
                _Seq(
                    req=req,
                    row=RowParams(
                        params.temperature,
                        params.top_k,
                        params.top_p,
                        params.min_p,
                        params.repetition_penalty,
                        gen,
                    ),
                )
            )
        fut.add_done_callback(self._on_done)
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            self.stats["requests"] += 1
            if mm is not None:
                self._vision_waiting.append(req)
            else:
                self._waiting.extend(req.seqs)
            self._cv.notify_all()
        return fut

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, int]:
        return {
            "running": len(self._batch.rows) + self.vision_rows(),
            "waiting": len(self._waiting) + sum(len(r.seqs) for r in self._vision_waiting),
        }

    def kv_used(self) -> int:
        """Tokens the running sequences hold in the KV cache (prompt + sampled so far), plus what the
        running requests with images reserve (vision_kv)."""
        return sum(len(s.req.prompt) + len(s.out) for s in list(self._batch.rows)) + self.vision_kv()

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        err = ShuttingDown("the server shut down before the request finished")
        vision = [r.seqs[0] for r in self._vision_waiting] + [r.req.seqs[0] for r in self._vision_running]
        for s in list(self._batch.rows) + list(self._waiting) + vision:
            if not s.req.future.done():
                s.req.future.set_exception(err)

    # -- scheduler -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():  # no autograd bookkeeping on any tensor the engine makes
            self._serve()

    def _serve(self) -> None:
        from hpcrl.monitor import watchdog

        while True:
            with self._cv:
                idle = self._paused or not (
                    self._waiting or self._batch.rows or self._vision_waiting or self._vision_running
                )
                if idle and not self._stopping:
                    self._cv.wait(timeout=IDLE_BEAT_S)
                if self._stopping:
                    return
            if idle:  # checked again next turn (woken by work, or IDLE_BEAT_S passed)
                self._idle_beat(watchdog)
                continue
            try:
                with self._weights_lock:
                    self._iteration()
                watchdog.beat("engine iteration")
            except Exception as e:  # an engine bug must fail the running requests, not the server
                log.exception("engine iteration failed")
                self.stats["engine_errors"] += 1
                err = EngineFailed(f"engine error: {type(e).__name__}: {e}")
                for s in self._batch.rows:
                    if not s.req.future.done():
                        s.req.future.set_exception(err)
                self._batch.clear()
                self._bparams = None

    def _idle_beat(self, watchdog: Any) -> None:
        """Idle is not stalled; but a weight swap that never finishes holds the weights lock, and then
        no beat comes and the watchdog ends the server."""
        if self._weights_lock.acquire(timeout=IDLE_BEAT_S):
            self._weights_lock.release()
            watchdog.beat("idle")

    def _iteration(self) -> None:
        self._drop_cancelled()
        if self._vision_waiting or self._vision_running:  # one step of each request with images
            self._vision_iteration()
        self._admit()
        batch = self._batch
        if not batch.rows:
            return
        rows: list[_Seq] = batch.rows
        if self._bparams is None:  # rebuilt only when the batch's membership changes
            self._bparams = BatchParams.of([s.row for s in rows], self.vocab_size, self.device)
        bp = self._bparams
        seen = (
            [s.req.prompt + s.out if s.row.repetition_penalty != 1.0 else None for s in rows]
            if bp.any_penalty
            else None
        )
        assert batch.logits is not None
        lp, greedy = processed_logprobs(batch.logits, bp, seen)
        tokens = sample(lp, greedy, bp, self._generator)
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k = max(s.req.params.top_logprobs for s in rows)
        tops = torch.topk(lp, k, dim=1) if k else None
        top_ids, top_lps = (tops.indices.tolist(), tops.values.tolist()) if tops is not None else (None, None)
        n = len(rows)
        self.stats["batch_size_hist"][n] += 1
        if n > self.stats["max_batch_size_seen"]:
            self.stats["max_batch_size_seen"] = n
        self.stats["generated_tokens"] += n
        finished = []
        for i, (s, tok) in enumerate(zip(rows, tokens.tolist())):
            s.out.append(tok)
            s.logprobs.append(chosen[i])
            s.steps.append(s.logits_step)
            if top_ids is not None and s.req.params.top_logprobs:
                m = s.req.params.top_logprobs
                s.top.append(list(zip(top_ids[i][:m], top_lps[i][:m])))
            self._check_finished(s, tok)
            if s.finish is not None:
                finished.append(i)
        for i in finished:
            self._maybe_complete(rows[i].req)
        if finished:
            order = self._retire(finished)
            tokens = tokens[torch.tensor(order, device=tokens.device)] if order else tokens[:0]
        if batch.rows:
            tokens = self._preempt(tokens)
        if batch.rows:
            batch.step(tokens)
            routed = self._routing.take(len(batch.rows))
            if routed is not None:
                for s, r in zip(batch.rows, routed):
                    s.routed.append(r)
            self.stats["forward_steps"] += 1
            for s in batch.rows:
                s.logits_step = self.policy_step

    def _preempt(self, tokens: torch.Tensor) -> torch.Tensor:
        """Before a decode step: if the rows no longer fit in the KV capacity, send the youngest back
        to the head of the queue (their tokens kept; resumed by recompute) and count them."""
        rows = self._batch.rows
        ages = [(s.req.arrived, s.req.seqs.index(s)) for s in rows]
        cap = self.kv_capacity - self.vision_kv()
        drop = kv_budget.victims([len(s.req.prompt) + len(s.out) for s in rows], ages, cap)
        if not drop:
            return tokens
        gone = [rows[i] for i in drop]  # youngest first
        order = self._retire(drop)
        with self._cv:
            for s in gone:  # the oldest ends at the head
                self._waiting.appendleft(s)
        self.stats["preemptions"] += len(gone)
        return tokens[torch.tensor(order, device=tokens.device)] if order else tokens[:0]

    def _retire(self, drop: list[int]) -> list[int]:
        self._bparams = None
        return self._batch.remove(drop)

    def _check_finished(self, s: _Seq, tok: int) -> None:
        p = s.req.params
        if tok in self.eos_ids and not p.ignore_eos:
            s.finish = "stop"
        elif tok in p.stop_token_ids:
            s.finish, s.stop_reason = "stop", tok
        elif p.stop:
            window = 4 * max(len(x) for x in p.stop) + 4
            tail = self.tokens.decode(s.out[-window:], p.skip_special_tokens)
            hit = next((x for x in p.stop if x in tail), None)
            if hit is not None:
                s.finish, s.stop_reason = "stop", hit
        if s.finish is None and len(s.out) >= s.req.max_tokens:
            s.finish = "length"

    def _maybe_complete(self, req: _Request) -> None:
        if req.future.done() or any(s.finish is None for s in req.seqs):
            return
        outs = []
        for s in req.seqs:
            text = self.tokens.decode(s.out, req.params.skip_special_tokens)
            if isinstance(s.stop_reason, str):
                cut = text.find(s.stop_reason)
                if cut >= 0:
                    text = text[: cut + (len(s.stop_reason) if req.params.include_stop_str_in_output else 0)]
            outs.append(
                SeqOutput(
                    token_ids=s.out,
                    logprobs=s.logprobs,
                    top_logprobs=s.top if req.params.top_logprobs else None,
                    text=text,
                    finish_reason=s.finish or "stop",
                    stop_reason=s.stop_reason,
                    policy_steps=sorted(set(s.steps)),
                    routed_experts=routing.finish(s.routed, len(s.out)) if self._routing.enabled else None,
                    prompt_routed_experts=None if req.prompt_routed is None else req.prompt_routed.tolist(),
                )
            )
        req.future.set_result(outs)

    def _drop_cancelled(self) -> None:
        """Forget sequences whose client went away (the HTTP handler cancelled the future)."""
        if not self._cancelled:
            return
        with self._cv:
            self._cancelled = False
            self._waiting = collections.deque(s for s in self._waiting if not s.req.future.cancelled())
            self._drop_cancelled_vision()
        drop = [i for i, s in enumerate(self._batch.rows) if s.req.future.cancelled()]
        if drop:
            self._retire(drop)

    def _on_done(self, fut: Future) -> None:
        if fut.cancelled():  # checked by the engine thread at its next iteration, not every step
            self._cancelled = True

    def _admit(self) -> None:
        # the rows and KV a waiting request with images needs are kept free for it (else text could
        # starve it)
        head_req = self._vision_waiting[0] if self._vision_waiting else None
        held = 0 if head_req is None else len(head_req.seqs)
        held_kv = 0 if head_req is None else held * (len(head_req.prompt) + head_req.max_tokens)
        free = self.max_batch_size - len(self._batch.rows) - self.vision_rows() - held
        if free <= 0 or not self._waiting:
            return
        with self._cv:
            head = [len(s.req.prompt) + len(s.out) for s in list(self._waiting)[:free]]
            used = self.kv_used() + held_kv
            n = kv_budget.admissible(head, used, self.kv_capacity, len(self._batch.rows))
            new = [self._waiting.popleft() for _ in range(n)]
        if not new:
            return
        # Sequences of one request share the prompt: prefill it once and fan the cache out. A preempted
        # sequence resumes from its prompt + the tokens it sampled (recompute, as vLLM preempts).
        firsts = {(id(s.req) if not s.out else id(s)): s for s in new}
        where = {k: j for j, k in enumerate(firsts)}
        kv, mask, pos, logits = self._prefill([s.req.prompt + s.out for s in firsts.values()])
        width = mask.shape[1]
        prompt_routed = self._routing.take(len(firsts) * width)  # left-padded rows: keep each prompt's
        if prompt_routed is not None:
            prompt_routed = prompt_routed.view(len(firsts), width, *prompt_routed.shape[1:])
            for j, s in enumerate(firsts.values()):
                if not s.out:
                    s.req.prompt_routed = prompt_routed[j, width - len(s.req.prompt) :].clone()
        idx = torch.tensor([where[id(s.req) if not s.out else id(s)] for s in new], device=self.device)
        for s in new:
            s.logits_step = self.policy_step
        self._bparams = None
        self._batch.add(new, kv, idx, mask, pos, logits)

    def _prefill(self, prompts: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        kv = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=kv,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats["prefills"] += 1
        self.stats["forward_steps"] += 1
        return out.past_key_values, mask, positions[:, -1] + 1, out.logits[:, -1].float()

    # -- weights: full updates and deltas in hpcrl.inference.engine_weights (EngineWeights) -----------
    def load_lora(self, name: str, path: str, step: int | None = None) -> str:
        """Merge the PEFT adapter under `path` into the base weights (replacing the previous adapter);
        return the checksum of its tensors. With `step` (LoRA RL: the adapter is policy `step`) the
        samples that follow are tagged with it."""
        cfg, raw = read_adapter(path)
        return self.merge_lora(name, path, cfg, raw, step)

    def merge_lora(
        self,
        name: str,
        source: str,
        cfg: dict[str, Any],
        raw: dict[str, torch.Tensor],
        step: int | None = None,
    ) -> str:
        """`load_lora` for an adapter already in memory (config + tensors: read from a dir, or received
        over the weight broadcast); `source` is what /weights reports it came from."""
        deltas = lora_deltas(cfg, raw, self._params, where=source)
        with self._update_lock, self._weights_lock:
            for pname in list(self._lora_base):  # undo the previous adapter first
                self._params[pname].copy_(self._lora_base.pop(pname))
            for pname, delta in deltas.items():
                p = self._params[pname]
                self._lora_base[pname] = p.detach().clone()
                p.add_(delta.to(device=p.device, dtype=p.dtype))
            self.lora_adapters = {name: source}
            self.lora_checksum = state_dict_checksum(raw)
            if step is not None:
                self.policy_step = int(step)
        return self.lora_checksum

    def score_prompt(self, ids: list[int]) -> list[float | None]:
        """Log-probability of every token of `ids` given its prefix (None for the first): vLLM's
        `prompt_logprobs`, which on-policy distillation asks of a teacher. Raw logits (temperature 1),
        one forward pass under the weights lock, so it never mixes two policies."""
        if not ids:
            return []
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        x = torch.tensor([ids], device=self.device)
        with self._weights_lock, torch.inference_mode():
            lp = prompt_logprobs(self.model, x)
        return [None, *lp.tolist()]

    def weights_info(self) -> dict[str, Any]:
        return {
            "step": self.policy_step,
            "checksum": self.checksum,
            "num_tensors": len(self._weight_names),
            "lora_adapters": dict(self.lora_adapters),
            "lora_checksum": self.lora_checksum,
        }

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The served weights under their HF names (tied aliases dropped): for tests and benchmarks."""
        return {n: self._params[n] for n in self._weight_names}
