"""Adaptive in-flight concurrency (issue 53; prime-rl #2902, #3285, #3307, #3309, #3556).

prometheus.py  read a /metrics text (vLLM's or the embedded engine's: the same names) -> ServerLoad
controller.py  the state machine: ServerLoads and completions in, a cap (and a cancel count) out
limiter.py     the asyncio gate the ServerPool's requests pass, resized and shed by the controller
poller.py      every poll_interval_s: scrape each server, feed the controller, apply its decision
"""
