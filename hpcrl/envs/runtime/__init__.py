"""The env-server runtime: a process that serves one environment to the orchestrator (server, workers, hosting on this node or another, lifeline, routing)."""
