"""`hpcrl eval` (baseline evaluation) and `hpcrl gepa` (GEPA system-prompt optimisation): args (command
lines), endpoint (own inference server or a given endpoint), rollouts (the orchestrator's rollout code
plus result rows), summary (avg@k / pass@k / no-signal check), run (eval), gepa_adapter + gepa_run."""
