"""RunPaths: the one place that knows every path under a run's output directory.

Nobody else joins path strings for run files. Layout (docs/architecture.md §4):

    <output_dir>/
      configs/                 resolved per-process configs (literal secrets as ${env:...} references)
      bus/endpoints/           doorbell addresses (one file per listening socket)
      bus/servers/             inference server addresses (one file per server)
      bus/rejected/            corrupt or foreign bus files moved aside
      bus/moved_aside/<tag>/   bus files newer than a resumed checkpoint
      rollouts/step_N/rank_R.msgpack
      rollouts/step_N/{train,eval}/traces.jsonl (+ traces.index.json)  every rollout, saved
      policy/step_N.msgpack
      control/                 control messages (stop, shutdown, ...); kill_inference_I.txt: the
                               orchestrator's order to a server's keepalive to kill frozen pid
      broadcasts/step_N/       filesystem weight broadcast, cleaned behind
      checkpoints/step_N/{trainer,orchestrator}/ + COMPLETE
      checkpoints/moved_aside/<tag>/step_N/  complete checkpoints newer than a resumed one
      weights/step_N/          HF model dir
      logs/{trainer,orchestrator,inference}.log, logs/envs/{train,eval}/<env>.log, logs/slurm/
      metrics.jsonl
      samples/step_N/<role>.jsonl  sampled rollouts (W&B log_extras), pointed to from metrics.jsonl
      token_exports/step_N/rank_R.jsonl (+ STABLE)  trainer.enable_token_export: per-token numbers
      wandb/                   W&B run id, sink offset, W&B's own files
      plots/
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_STEP_RE = re.compile(r"^step_(\d+)$")
_STEP_FILE_RE = re.compile(r"^step_(\d+)\.msgpack$")
_RANK_FILE_RE = re.compile(r"^rank_(\d+)\.msgpack$")

ROLES = ("trainer", "orchestrator", "inference")


def parse_step_dir(name: str) -> int | None:
    """`step_12` -> 12; anything else -> None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_step_file(name: str) -> int | None:
    """`step_12.msgpack` -> 12; anything else -> None."""
    m = _STEP_FILE_RE.match(name)
    return int(m.group(1)) if m else None


def parse_rank_file(name: str) -> int | None:
    """`rank_3.msgpack` -> 3; anything else -> None."""
    m = _RANK_FILE_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunPaths:
    """Every path under one run's output directory."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root).absolute())

    # -- configs -------------------------------------------------------------------------
    @property
    def configs_dir(self) -> Path:
        return self.root / "configs"

    def process_config(self, role: str) -> Path:
        """Resolved config of one process role, e.g. configs/trainer.toml."""
        return self.configs_dir / f"{role}.toml"

    @property
    def resolved_config(self) -> Path:
        """The whole resolved config (all sections), used by resume."""
        return self.configs_dir / "resolved.toml"

    # -- bus -----------------------------------------------------------------------------
    @property
    def bus_dir(self) -> Path:
        return self.root / "bus"

    @property
    def endpoints_dir(self) -> Path:
        return self.bus_dir / "endpoints"

    def endpoint_file(self, name: str) -> Path:
        """Address file of one doorbell socket, e.g. bus/endpoints/trainer_rank_0.json."""
        return self.endpoints_dir / f"{name}.json"

    @property
    def servers_dir(self) -> Path:
        return self.bus_dir / "servers"

    @property
    def env_specs_dir(self) -> Path:
        """bus/envs/: what the env nodes' hosts start (deployment.env_nodes > 0, hpcrl.envs.runtime.host)."""
        return self.bus_dir / "envs"

    def env_spec_file(self, kind: str, env_name: str) -> Path:
        """The orchestrator's order for one env server: which env node, and its ServerSpec."""
        return self.env_specs_dir / f"{kind}--{env_name}.json"

    def env_exit_file(self, kind: str, env_name: str) -> Path:
        """Written by the env node's host when that env server exited (its connect, restarts, code)."""
        return self.env_specs_dir / f"{kind}--{env_name}.exit"

    @property
    def weights_fallback_file(self) -> Path:
        """Written by the orchestrator when a server of a collective-transport run died: the trainer
        publishes policies as files from then on (the weight group cannot take a new member)."""
        return self.bus_dir / "weights_fallback"

    def server_file(self, index: int) -> Path:
        """Address file of inference server `index` (written by the server when it is ready)."""
        return self.servers_dir / f"server_{index}.json"

    @property
    def rejected_dir(self) -> Path:
        return self.bus_dir / "rejected"

    def moved_aside_dir(self, tag: str) -> Path:
        return self.bus_dir / "moved_aside" / tag

    @property
    def rollouts_dir(self) -> Path:
        return self.root / "rollouts"

    def rollout_step_dir(self, step: int) -> Path:
        return self.rollouts_dir / f"step_{step}"

    def rollout_file(self, step: int, rank: int) -> Path:
        return self.rollout_step_dir(step) / f"rank_{rank}.msgpack"

    def saved_rollouts_file(self, step: int, split: str) -> Path:
        """Every rollout of one step and split ("train" / "eval"), one JSON object per line, kept
        beside the bus batches by their own retention (hpcrl.orchestrator.rollout_log)."""
        return self.rollout_step_dir(step) / split / "traces.jsonl"

    def saved_rollouts_index(self, step: int, split: str) -> Path:
        """The byte-offset index of saved_rollouts_file (hpcrl.monitor.rollout_files)."""
        return self.rollout_step_dir(step) / split / "traces.index.json"

    def token_export_file(self, step: int, rank: int) -> Path:
        """trainer.enable_token_export: rank R's samples of step N with the trainer's per-token numbers
        (hpcrl.trainer.token_export); ``STABLE`` beside it once every rank wrote its file."""
        return self.root / "token_exports" / f"step_{step}" / f"rank_{rank}.jsonl"

    @property
    def policy_dir(self) -> Path:
        return self.root / "policy"

    def policy_file(self, step: int) -> Path:
        return self.policy_dir / f"step_{step}.msgpack"

    @property
    def policy_latest_file(self) -> Path:
        """The newest published policy's step (ASCII), a hint that spares readers a listing of policy/."""
        return self.policy_dir / "LATEST"

    @property
    def control_dir(self) -> Path:
        return self.root / "control"

    def control_file(self, name: str) -> Path:
        return self.control_dir / f"{name}.msgpack"

    def kill_order_file(self, index: int) -> Path:
        """The orchestrator's order to server `index`'s keepalive (hpcrl.launch.keepalive, on the
        server's node) to SIGKILL the pid written in it: a server frozen past
        orchestrator.server_down_timeout_s on another host, where the orchestrator cannot kill it
        itself and SLURM could not (hpcrl.orchestrator.server_end)."""
        return self.control_dir / f"kill_inference_{index}.txt"

    # -- weights ---------------------------------------------------------------------------
    @property
    def broadcasts_dir(self) -> Path:
        return self.root / "broadcasts"

    def broadcast_dir(self, step: int) -> Path:
        return self.broadcasts_dir / f"step_{step}"

    @property
    def adapters_dir(self) -> Path:
        """LoRA adapters kept for use after training ([adapters] interval)."""
        return self.root / "adapters"

    def adapter_dir(self, step: int) -> Path:
        return self.adapters_dir / f"step_{step}"

    @property
    def weights_root(self) -> Path:
        return self.root / "weights"

    def weights_dir(self, step: int) -> Path:
        return self.weights_root / f"step_{step}"

    def online_eval_dir(self, step: int) -> Path:
        """evals/step_N/: an SFT run's online evaluation of step N (an `hpcrl eval` output directory,
        its config eval.toml, and the HF weights it scores in weights/)."""
        return self.root / "evals" / f"step_{step}"

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step}"

    def checkpoints_moved_aside_dir(self, tag: str) -> Path:
        return self.checkpoints_dir / "moved_aside" / tag

    def trainer_ckpt_dir(self, step: int) -> Path:
        return self.checkpoint_dir(step) / "trainer"

    def trainer_rank_ckpt(self, step: int, rank: int) -> Path:
        return self.trainer_ckpt_dir(step) / f"rank_{rank}.pt"

    def orchestrator_ckpt_dir(self, step: int) -> Path:
        return self.checkpoint_dir(step) / "orchestrator"

    def complete_file(self, step: int) -> Path:
        """The manifest written last; its presence and validity make step_N a checkpoint."""
        return self.checkpoint_dir(step) / "COMPLETE"

    # -- logs and metrics ----------------------------------------------------------------------
    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def log_file(self, role: str) -> Path:
        """logs/trainer.log, logs/orchestrator.log, logs/inference.log, logs/launcher.log."""
        return self.logs_dir / f"{role}.log"

    def rank_log_file(self, role: str, rank: int) -> Path:
        """Per-rank / per-server log, e.g. logs/trainer/rank_1.log."""
        return self.logs_dir / role / f"rank_{rank}.log"

    def env_log_file(self, kind: str, env_name: str) -> Path:
        """logs/envs/{train,eval}/<env>.log."""
        return self.logs_dir / "envs" / kind / f"{env_name}.log"

    def env_server_dir(self, kind: str, env_name: str) -> Path:
        """logs/envs/{train,eval}/<env>/: server.log, worker_<i>.log, components.json."""
        return self.logs_dir / "envs" / kind / env_name

    @property
    def slurm_logs_dir(self) -> Path:
        return self.logs_dir / "slurm"

    @property
    def placement_log(self) -> Path:
        """One JSON line per process start: role, rank, node, gpus it sees, host, port."""
        return self.logs_dir / "placement.jsonl"

    def placement_file(self, role: str, rank: int) -> Path:
        """The newest placement of one process (what `hpcrl status` shows)."""
        return self.logs_dir / "placement" / f"{role}_{rank}.json"

    @property
    def causes_file(self) -> Path:
        """Errored rollouts by env and cause, totals (orchestrator; `hpcrl status` shows the top)."""
        return self.logs_dir / "causes.json"

    @property
    def progress_dir(self) -> Path:
        """logs/progress/<role>.json: what each role last did and what it waits on (stall reports)."""
        return self.logs_dir / "progress"

    @property
    def stalls_dir(self) -> Path:
        """logs/stalls/: Python stacks of every live process, written when a stall is named."""
        return self.logs_dir / "stalls"

    @property
    def prompts_log(self) -> Path:
        """One JSON line per published step: the example ids trained on (orchestrator)."""
        return self.logs_dir / "prompts.jsonl"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    @property
    def samples_dir(self) -> Path:
        return self.root / "samples"

    def samples_file(self, step: int, role: str) -> Path:
        """Sampled rollouts of one step, one JSON object per line (Metrics.log_samples)."""
        return self.samples_dir / f"step_{step}" / f"{role}.jsonl"

    @property
    def wandb_dir(self) -> Path:
        """W&B's files (offline runs live here until `wandb sync`) and the sink's own state."""
        return self.root / "wandb"

    @property
    def wandb_run_id_file(self) -> Path:
        """The W&B run id, fixed at the first start so every resume continues the same W&B run."""
        return self.wandb_dir / "run_id"

    @property
    def wandb_sink_offset(self) -> Path:
        """Byte offset into metrics.jsonl up to which the W&B sink has logged (resume skips it)."""
        return self.wandb_dir / "sink_offset"

    @property
    def slurm_dir(self) -> Path:
        """Rendered sbatch script, submitit folder and job id."""
        return self.root / "slurm"

    @property
    def job_file(self) -> Path:
        """Records the SLURM job id (or local launcher pid) that owns this run."""
        return self.root / "job.json"

    @property
    def stop_request_file(self) -> Path:
        """Written by `hpcrl cancel --checkpoint` before it signals a SLURM job: the job's batch script
        then checkpoints and ends instead of requeueing. Removed by the next submit or resume."""
        return self.root / "slurm" / "stop_requested"

    # -- listing helpers -----------------------------------------------------------------------
    @staticmethod
    def steps_in(directory: Path) -> list[int]:
        """Sorted steps of the `step_N` entries (dirs or `.msgpack` files) directly under `directory`."""
        if not directory.is_dir():
            return []
        steps = set()
        for p in directory.iterdir():
            s = parse_step_dir(p.name)
            if s is None:
                s = parse_step_file(p.name)
            if s is not None:
                steps.add(s)
        return sorted(steps)

    def make_dirs(self) -> None:
        """Create the directories every role expects to exist."""
        for d in (
            self.configs_dir,
            self.endpoints_dir,
            self.servers_dir,
            self.rollouts_dir,
            self.policy_dir,
            self.control_dir,
            self.checkpoints_dir,
            self.weights_root,
            self.logs_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class EvalPaths:
    """The output directory of `hpcrl eval` / `hpcrl gepa`:

    results.jsonl  summary.json  config.json  logs/{eval,gepa,inference*}.log
    best_prompt.txt  system_prompt.txt  pareto_frontier.jsonl  metadata.json   (gepa)
    gepa/                                                                      (gepa's own state: resume)
    """

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def results_file(self) -> Path:
        return self.root / "results.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.root / "summary.json"

    @property
    def config_file(self) -> Path:
        return self.root / "config.json"

    def log_file(self, role: str) -> Path:
        return self.root / "logs" / f"{role}.log"

    def env_server_dir(self, kind: str, env_name: str) -> Path:
        """logs/envs/<kind>/<env>/ of an eval or GEPA run's env servers."""
        return self.root / "logs" / "envs" / kind / env_name

    @property
    def gepa_state_dir(self) -> Path:
        """gepa's run_dir: its pickled state (gepa_state.bin) and run log; a rerun resumes from it."""
        return self.root / "gepa"

    @property
    def best_prompt_file(self) -> Path:
        return self.root / "best_prompt.txt"

    @property
    def system_prompt_file(self) -> Path:
        return self.root / "system_prompt.txt"

    @property
    def pareto_file(self) -> Path:
        return self.root / "pareto_frontier.jsonl"

    @property
    def metadata_file(self) -> Path:
        return self.root / "metadata.json"
