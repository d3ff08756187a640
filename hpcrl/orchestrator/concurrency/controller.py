"""The adaptive in-flight cap: a plain state machine (prime-rl's ConcurrencyController, #2902, #3285,
#3307, #3309; the growth taper of #3556). It owns no task, client or clock: the poller feeds it each
server's load every poll (`observe`) and the pool reports each answered request (`completed`); both
return a Decision (the new cap, and how many in-flight requests to cancel, youngest first) or None.

- Start: `initial_inflight`, else the servers' KV capacity / max context length (pessimistic: every
  request may grow to the full context), clamped to [min_inflight, max_inflight].
- Grow: x1.25 per full turnover of the in-flight pool (each completion advances it by 1/inflight)
  while nothing waits, no cut is draining, the cap binds (inflight >= 90 % of it), the last poll
  is fresh and the servers hold at least half of what is in flight (hpcrl's addition: requests
  stuck in transit); the factor tapers from 1.25 at 60 % KV usage to 1.00 at 80 % (#3556). Growth
  between two polls is bounded by x1.25 (hpcrl's addition: short requests turn the pool over many
  times per poll, and growth must not outrun what the polls can see).
- Trim: above 80 % usage, to inflight x 70 % / usage (then 6 polls of cooldown); above 90 % also
  cancel the excess, youngest first.
- Cut: new preemptions -> x0.8 of inflight; a queue (waiting > 50 % of running) for 6 polls in a
  row -> x0.9; a repeat overload within 6 polls after the last cut drained -> x0.5. A cut cancels
  the excess and freezes further cuts until inflight is under the new cap and the servers are calm.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from hpcrl.orchestrator.concurrency.prometheus import ServerLoad

log = logging.getLogger("hpcrl.orchestrator.concurrency")

TURNOVER_GROWTH = 1.25
BINDING_FRACTION = 0.9
KV_USAGE_GROW = 0.6  # full growth below this usage ...
KV_USAGE_GROW_STOP = 0.8  # ... tapering to none at this one (#3556)
KV_USAGE_SOFT_CAP = 0.8  # trim above
KV_USAGE_HARD_CAP = 0.9  # trim and cancel above
KV_USAGE_TARGET = 0.7  # a trim aims here
KV_TRIM_COOLDOWN_POLLS = 6
QUEUE_RATIO = 0.5
QUEUE_PERSISTENCE_POLLS = 6
QUEUE_CUT_FRACTION = 0.9
PREEMPTION_CUT_FRACTION = 0.8
ESCALATED_CUT_FRACTION = 0.5
ESCALATION_GRACE_POLLS = 6
STALE_POLLS = 3  # growth freezes when the last poll is older than this many intervals
# Growth also freezes while the servers see (running + waiting) less than this fraction of what the
# pool has in flight: the rest is stuck on the way (an HTTP front or a client too loaded to keep up),
# where KV usage cannot show it. hpcrl's unit is a request at a server, never an episode idle between
# turns, so unlike prime-rl's pool (#3309) there is no duty cycle to excuse the gap.
TRANSIT_FRACTION = 0.5

SIGNALS = {"clear": 0, "soft": 1, "hard": 2}


@dataclass(frozen=True)
class Decision:
    limit: int
    cancel: int = 0
    reason: str | None = None


def growth_factor(usage: float) -> float:
    """Growth per full turnover at this KV usage: 1.25 up to 60 %, tapering linearly (in the exponent)
    to 1.00 at 80 % (#3556)."""
    if usage <= KV_USAGE_GROW:
        return TURNOVER_GROWTH
    if usage >= KV_USAGE_GROW_STOP:
        return 1.0
    return TURNOVER_GROWTH ** ((KV_USAGE_GROW_STOP - usage) / (KV_USAGE_GROW_STOP - KV_USAGE_GROW))


@dataclass
class Controller:
    """`adaptive = False`: the cap stays at max_inflight (the fixed mode); observe() only keeps the
    gauges, so both modes report the same metrics."""

    min_inflight: int
    max_inflight: int
    initial_inflight: int | None = None
    adaptive: bool = True
    poll_interval_s: float = 5.0
    cap: float = field(init=False)
    limit: int = field(init=False)
    bootstrapped: bool = field(init=False)
    turnover: float = 0.0
    signal: str = "clear"
    usage: float = 0.0  # the fullest server's, last poll
    capacity: dict[str, int] = field(default_factory=dict)  # KV tokens per server
    cancelled: int = 0  # requests cancelled (cumulative)
    cuts: int = 0
    trims: int = 0
    can_grow: bool = False
    grow_ceiling: float = 0.0  # the most the cap may reach before the next poll (x1.25 of the last)
    polled_at: float = -math.inf
    prev_waiting: dict[str, int] = field(default_factory=dict)
    prev_preemptions: dict[str, int] = field(default_factory=dict)
    new_preemptions: int = 0  # cumulative, counted from the first poll of each server
    queue_polls: int = 0
    trim_cooldown: int = 0
    draining: bool = False
    escalated: bool = False
    grace: int = 0

    def __post_init__(self) -> None:
        if not self.adaptive:
            self.cap = float(self.max_inflight)
        else:
            self.cap = self.clamp(float(self.initial_inflight or self.min_inflight))
        self.limit = int(self.cap)
        self.bootstrapped = not self.adaptive or self.initial_inflight is not None

    def clamp(self, n: float) -> float:
        return min(max(n, float(self.min_inflight)), float(self.max_inflight))

    # -- inbound ---------------------------------------------------------------------------------------
    def completed(self, inflight: int, ok: bool, now: float, weight: int = 1) -> Decision | None:
        """A request of `weight` units answered (`inflight`: units still in flight, this one's
        excluded). Advances the turnover by weight / pool and, while the last poll allowed it, grows
        the cap by growth^(weight / pool)."""
        pool = inflight + weight
        frac = weight / pool
        self.turnover += frac
        if not (self.adaptive and ok and self.can_grow):
            return None
        if now - self.polled_at > STALE_POLLS * self.poll_interval_s or pool < BINDING_FRACTION * self.limit:
            return None
        self.cap = min(
            self.clamp(self.cap * growth_factor(self.usage) ** frac), max(self.cap, self.grow_ceiling)
        )
        return self._apply(int(self.cap), 0, None)

    def observe(
        self, loads: dict[str, ServerLoad], inflight: int, max_model_len: int, now: float
    ) -> Decision | None:
        """One poll of every server that answered: classify the pressure, gate growth, trim or cut."""
        if not loads:
            return None
        self.polled_at = now
        preempted = 0
        for name, ld in loads.items():
            if ld.kv_capacity_tokens:
                self.capacity[name] = ld.kv_capacity_tokens
            prev = self.prev_preemptions.get(name)
            if prev is not None and ld.preemptions > prev:
                preempted += ld.preemptions - prev
            self.prev_preemptions[name] = ld.preemptions
        self.new_preemptions += preempted
        usage = max(ld.kv_usage for ld in loads.values())
        running = sum(ld.running for ld in loads.values())
        queued = sum(
            ld.waiting if ld.waiting_capacity is None else ld.waiting_capacity for ld in loads.values()
        )
        waited = any(ld.waiting > 0 and self.prev_waiting.get(n, 0) > 0 for n, ld in loads.items())
        self.prev_waiting = {n: ld.waiting for n, ld in loads.items()}
        self.usage = usage
        self.queue_polls = self.queue_polls + 1 if running > 0 and queued > QUEUE_RATIO * running else 0
        queue_overload = self.queue_polls >= QUEUE_PERSISTENCE_POLLS
        sig = (
            "hard"
            if preempted or queue_overload
            else ("soft" if waited or usage > KV_USAGE_GROW else "clear")
        )
        self.signal = sig
        if not self.adaptive:
            return None
        if self.draining and inflight <= self.limit and not preempted and not queue_overload:
            self.draining, self.grace = False, ESCALATION_GRACE_POLLS
        if not self.draining and self.escalated:
            self.grace -= 1
            self.escalated = self.grace > 0
        self.trim_cooldown = max(0, self.trim_cooldown - 1)
        in_transit = (
            inflight > 0 and running + sum(ld.waiting for ld in loads.values()) < TRANSIT_FRACTION * inflight
        )
        self.can_grow = (
            queued == 0
            and not waited
            and not preempted
            and not self.draining
            and not in_transit
            and usage < KV_USAGE_GROW_STOP
        )
        # Short requests turn the pool over many times between two polls: growth that compounded
        # blind would overshoot before any poll could see it. At most one turnover's worth (x1.25)
        # per poll (hpcrl's addition to #3285's per-turnover pacing).
        self.grow_ceiling = self.cap * TURNOVER_GROWTH
        boot: Decision | None = None
        if not self.bootstrapped and self.capacity:
            self.bootstrapped = True
            self.cap = self.clamp(sum(self.capacity.values()) / max(1, max_model_len))
            self.grow_ceiling = self.cap * TURNOVER_GROWTH
            boot = self._apply(int(self.cap), 0, "start: KV capacity / max context")
        if self.draining:
            return boot
        if preempted or queue_overload:
            frac = ESCALATED_CUT_FRACTION if self.escalated else None
            if queue_overload:
                self.queue_polls = 0
                target, reason = inflight * (frac or QUEUE_CUT_FRACTION), "queue"
            else:
                target, reason = inflight * (frac or PREEMPTION_CUT_FRACTION), f"{preempted} preemption(s)"
            self.cuts += 1
            self.draining = self.escalated = True
            return self._down(int(self.clamp(target)), inflight, reason, cancel=True) or boot
        if usage > KV_USAGE_SOFT_CAP and inflight > 0 and self.trim_cooldown == 0:
            hard = usage > KV_USAGE_HARD_CAP
            self.trim_cooldown, self.trims = KV_TRIM_COOLDOWN_POLLS, self.trims + 1
            target = int(self.clamp(inflight * KV_USAGE_TARGET / usage))
            return self._down(target, inflight, f"KV usage {usage:.2f}", cancel=hard) or boot
        return boot

    # -- internals -------------------------------------------------------------------------------------
    def _down(self, target: int, inflight: int, reason: str, cancel: bool) -> Decision | None:
        target = min(target, self.limit)
        self.cap = float(target)
        shed = max(0, inflight - target) if cancel else 0
        self.cancelled += shed
        return self._apply(target, shed, reason)

    def _apply(self, limit: int, cancel: int, reason: str | None) -> Decision | None:
        if limit == self.limit and not cancel:
            return None
        if reason is not None:
            log.info(
                "concurrency %d -> %d (%s)%s",
                self.limit,
                limit,
                reason,
                f", cancelling {cancel}" if cancel else "",
            )
        self.limit = limit
        return Decision(limit, cancel, reason)

    # -- outbound --------------------------------------------------------------------------------------
    def per_server(self, names: list[str]) -> dict[str, int]:
        """The cap split over the servers by KV capacity (evenly while unknown), each at least 1."""
        cap = {n: self.capacity.get(n, 0) for n in names}
        total = sum(cap.values())
        if not total or any(v == 0 for v in cap.values()):
            return {n: max(1, math.ceil(self.limit / len(names))) for n in names}
        return {n: max(1, math.ceil(self.limit * v / total)) for n, v in cap.items()}

    def metrics(self) -> dict[str, float]:
        return {
            "concurrency/limit": float(self.limit),
            "concurrency/turnover": self.turnover,
            "concurrency/signal": float(SIGNALS[self.signal]),
            "concurrency/kv_capacity_tokens": float(sum(self.capacity.values())),
            "concurrency/cuts": float(self.cuts),
            "concurrency/trims": float(self.trims),
            "concurrency/preemptions": float(self.new_preemptions),
        }
