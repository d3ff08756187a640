"""[orchestrator.concurrency]: how many rollout requests are in flight at once (issue 53).

prime-rl's table under prime-rl's names (#2902, #3285, #3307, #3309, #3556): `initial_inflight`,
`min_inflight`, `max_inflight`. hpcrl adds `mode`: `fixed` keeps the cap at
`orchestrator.max_concurrent` (hpcrl's behaviour before issue 53, the default without this table);
`adaptive` lets hpcrl.orchestrator.concurrency size it from the servers' /metrics. A table written
without `mode` (prime-rl's shape) means adaptive, as in prime-rl (hpcrl.config.prime_shapes)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from hpcrl.config.sections.base import D, Section


class ConcurrencyConfig(Section):
    mode: Annotated[
        Literal["fixed", "adaptive"],
        D(
            "fixed: orchestrator.max_concurrent requests in flight; adaptive: a cap sized from the "
            "inference servers' KV usage, queue and preemptions (docs/observability.md)."
        ),
    ] = "fixed"
    initial_inflight: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        D("Adaptive: the starting cap (unset: the servers' KV capacity / max context length)."),
    ] = None
    min_inflight: Annotated[int, D("Adaptive: the cap never goes below this.", ge=1)] = 1
    max_inflight: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        D("Adaptive: the cap never goes above this (unset: orchestrator.max_concurrent)."),
    ] = None
    poll_interval_s: Annotated[
        float,
        D("Seconds between scrapes of every server's /metrics (both modes: the inference/* gauges).", gt=0),
    ] = 5.0

    def __post_init__(self) -> None:
        top = self.max_inflight
        if top is not None and self.min_inflight > top:
            raise ValueError(f"min_inflight = {self.min_inflight} exceeds max_inflight = {top}")
        if top is not None and self.initial_inflight is not None and self.initial_inflight > top:
            raise ValueError(f"initial_inflight = {self.initial_inflight} exceeds max_inflight = {top}")
        if self.initial_inflight is not None and self.initial_inflight < self.min_inflight:
            raise ValueError(
                f"initial_inflight = {self.initial_inflight} is below min_inflight = {self.min_inflight}"
            )
