"""The hf engine's requests with images (a vision-language model: its config has a vision_config).

A chat request whose messages hold image parts (OpenAI ``image_url`` with a data URL) is rendered by
the chat template, each image token expanded to the image's merged patches
(hpcrl.models.vision_inputs.ImageInputs, the same expansion the orchestrator and the trainer use),
and served by the model's own transformers class: one prefill (batch 1: the vision encoder runs once per
request, whatever its n) with pixel_values / image_grid_thw / mm_token_type_ids, its KV cache then
repeated across the n rows, and the multimodal RoPE offset kept with the request. Each engine
iteration (under the weights lock, as the text batch) takes one decode step of every running request
with images beside one step of the text rows, so weight updates and text requests interleave with a
long image request; each token records the policy step of the forward that produced it. Its n rows
count against max_batch_size, and it reserves n * (prompt + max_tokens) of the KV budget. A request
that fails fails alone (its answer names the cause). Sampling, stop rules and the response are the
text path's own.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.inference.content import DATA_URL
from hpcrl.inference.errors import InvalidRequest
from hpcrl.inference.sampling import BatchParams, processed_logprobs, sample
from hpcrl.models.vision_inputs import ImageInputs, image_refs

log = logging.getLogger("hpcrl.inference.engine")


def vision_model_class(config: Any) -> Any:
    """transformers' auto class for this config: image-text-to-text for a VLM, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )


@dataclass(eq=False)
class _VisionRun:
    """A running request with images: its own KV cache (n rows), RoPE offset and pending logits."""

    req: Any  # hpcrl.inference.engine._Request
    cache: Any = None
    rope_deltas: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [n, vocab] float
    logits_step: int = 0  # policy step of the forward that produced `logits`
    bp: Any = None  # BatchParams of its rows


class VisionServing:
    """HFEngine's part for requests with images (mixed in; uses its model, tokens, lock and rows)."""

    images: ImageInputs | None = None
    _vision_waiting: collections.deque
    _vision_running: list[_VisionRun]

    def _init_vision(self, model_path: str, trust_remote_code: bool) -> None:
        self._vision_waiting = collections.deque()
        self._vision_running = []
        cfg = self.model.config  # type: ignore[attr-defined]
        if getattr(cfg, "vision_config", None) is not None:
            self.images = ImageInputs(model_path, self.tokenizer, trust_remote_code, field="model.name")  # type: ignore[attr-defined]

    def vision_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt ids (image tokens expanded) and image tensors of messages with image parts."""
        if self.images is None:
            raise InvalidRequest(
                "image content parts need a vision-language model; this one is text only", param="messages"
            )
        refs = image_refs(messages)
        if not all(isinstance(r, str) and DATA_URL.match(r) for r in refs):  # parse_messages checked
            raise InvalidRequest("images must be data:image/...;base64, URLs", param="messages")
        try:
            mm = self.images.encode(refs, "messages image")
        except ValueError as e:
            raise InvalidRequest(str(e), param="messages") from None
        tokens = self.tokens  # type: ignore[attr-defined]
        with tokens._lock:
            text = tokens.chat_text(
                messages, tools, add_generation_prompt, continue_final_message, template_kwargs
            )
        try:
            text = self.images.expand(text, self.images.tokens_per_image(mm["image_grid_thw"]))
        except ValueError as e:
            raise InvalidRequest(str(e), param="messages") from None
        return tokens.encode_text(text), mm

    # -- scheduling: each image request steps once per engine iteration, beside the text rows --------
    def vision_rows(self) -> int:
        """Rows the running image requests hold (they count against max_batch_size)."""
        return sum(len(r.req.seqs) for r in self._vision_running)

    def vision_kv(self) -> int:
        """KV tokens reserved by the running image requests: each row's prompt + max_tokens (their
        caches are not preempted, so they reserve what they may grow to)."""
        return sum(len(r.req.seqs) * (len(r.req.prompt) + r.req.max_tokens) for r in self._vision_running)

    def _vision_iteration(self) -> None:
        """Admit (prefill) at most one waiting image request, then one step (sample, decode forward)
        of every running one. A failing request fails alone: its future names the cause."""
        self._admit_vision()
        for run in list(self._vision_running):
            try:
                self._vision_step(run)
            except Exception as e:
                self._vision_failed(run, e)

    def _vision_failed(self, run: _VisionRun, e: Exception) -> None:
        from hpcrl.inference.errors import EngineFailed

        log.warning("a request with images failed: %s: %s", type(e).__name__, e)
        self.stats["engine_errors"] += 1  # type: ignore[attr-defined]
        if run in self._vision_running:
            self._vision_running.remove(run)
        if not run.req.future.done():
            run.req.future.set_exception(
                EngineFailed(f"the request with images failed: {type(e).__name__}: {e}")
            )
        self._clear_rope_deltas()

    def _admit_vision(self) -> None:
        if not self._vision_waiting:
            return
        req = self._vision_waiting[0]
        n, need = len(req.seqs), len(req.seqs) * (len(req.prompt) + req.max_tokens)
        rows = len(self._batch.rows) + self.vision_rows()  # type: ignore[attr-defined]
        alone = rows == 0
        used = self.kv_used()  # type: ignore[attr-defined]
        if not alone and (rows + n > self.max_batch_size or used + need > self.kv_capacity):  # type: ignore[attr-defined]
            return  # waits for room (FCFS among image requests); a lone one always runs
        self._vision_waiting.popleft()
        if req.future.done():
            return
        run = _VisionRun(req)
        try:
            self._vision_prefill(run)
        except Exception as e:
            self._vision_failed(run, e)
            return
        self._vision_running.append(run)

    def _vision_prefill(self, run: _VisionRun) -> None:
        """The prompt with its images, once (batch 1: the vision encoder runs once), its cache then
        repeated across the request's n rows."""
        assert self.images is not None
        from transformers import DynamicCache

        model, dev, req = self.model, self.device, run.req  # type: ignore[attr-defined]
        ids = torch.tensor([req.prompt], device=dev)
        dtype = next(model.parameters()).dtype
        run.cache = DynamicCache(config=model.config)
        try:
            logits = model(
                input_ids=ids,
                pixel_values=req.mm["pixel_values"].to(dev, dtype),
                image_grid_thw=req.mm["image_grid_thw"].to(dev),
                mm_token_type_ids=(ids == self.images.image_id).long(),
                past_key_values=run.cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            run.rope_deltas = getattr(getattr(model, "model", None), "rope_deltas", None)
        finally:
            self._clear_rope_deltas()
        n = len(req.seqs)
        if n > 1:
            run.cache.batch_repeat_interleave(n)
        run.logits = logits.float().expand(n, -1)
        run.logits_step = self.policy_step  # type: ignore[attr-defined]
        run.bp = BatchParams.of([s.row for s in req.seqs], self.vocab_size, dev)  # type: ignore[attr-defined]
        req.mm = None  # the pixels are in the cache now
        self.stats["prefills"] += 1  # type: ignore[attr-defined]
        self.stats["forward_steps"] += 1  # type: ignore[attr-defined]

    def _vision_step(self, run: _VisionRun) -> None:
        """Sample one token per row from the pending logits; unless all rows finished, one decode
        forward for the next (its policy step recorded, as the text rows do)."""
        req, seqs, bp = run.req, run.req.seqs, run.bp
        stats = self.stats  # type: ignore[attr-defined]
        seen = (
            [req.prompt + s.out if s.row.repetition_penalty != 1.0 else None for s in seqs]
            if bp.any_penalty
            else None
        )
        lp, greedy = processed_logprobs(run.logits, bp, seen)
        tokens = sample(lp, greedy, bp, self._generator)  # type: ignore[attr-defined]
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k = req.params.top_logprobs
        tops = torch.topk(lp, k, dim=1) if k else None
        for i, (s, tok) in enumerate(zip(seqs, tokens.tolist())):
            if s.finish is not None:  # a finished row rides along until the others finish
                continue
            s.out.append(tok)
            s.logprobs.append(chosen[i])
            s.steps.append(run.logits_step)
            if tops is not None:
                s.top.append(list(zip(tops.indices[i].tolist(), tops.values[i].tolist())))
            self._check_finished(s, tok)  # type: ignore[attr-defined]
            stats["generated_tokens"] += 1
        if all(s.finish is not None for s in seqs):
            self._vision_running.remove(run)
            self._maybe_complete(req)  # type: ignore[attr-defined]
            return
        inner = getattr(self.model, "model", None)  # type: ignore[attr-defined]
        if inner is not None and hasattr(inner, "rope_deltas"):
            inner.rope_deltas = run.rope_deltas  # this request's multimodal RoPE offset, not another's
        try:
            out = self.model(input_ids=tokens.unsqueeze(1), past_key_values=run.cache, use_cache=True)  # type: ignore[attr-defined]
        finally:
            self._clear_rope_deltas()
        run.logits = out.logits[:, -1].float()
        run.logits_step = self.policy_step  # type: ignore[attr-defined]
        stats["forward_steps"] += 1

    def _clear_rope_deltas(self) -> None:
        inner = getattr(self.model, "model", None)  # type: ignore[attr-defined]
        if inner is not None and hasattr(inner, "rope_deltas"):
            inner.rope_deltas = None

    def _drop_cancelled_vision(self) -> None:
        self._vision_waiting = collections.deque(r for r in self._vision_waiting if not r.future.cancelled())
        self._vision_running = [r for r in self._vision_running if not r.req.future.cancelled()]
