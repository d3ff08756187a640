"""The `hpcrl` command. Thin: parses, validates, then imports the heavy module of the chosen command.

Every user error (hpcrl.errors.UserError) is one line on stderr and exit code 2, never a traceback;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.errors import UserError, user_errors

if TYPE_CHECKING:
    from hpcrl.config.loader import Loaded

USAGE = """usage: hpcrl <command> [cfg.toml | @ a.toml @ b.toml] [--section.field value ...]

commands:
  run              trainer + orchestrator + inference on this machine (CPU or GPUs)
  submit           one heterogeneous SLURM job (trainer nodes + inference nodes); --nodes N
  resume           continue a run from its newest complete checkpoint (--step -1 | N)
  sft              supervised fine-tuning from a local dataset
  inference        serve a model over an OpenAI-compatible HTTP API
  trainer          one trainer rank (started by run/submit; RANK/WORLD_SIZE from the environment)
  orchestrator     the rollout orchestrator (started by run/submit)
  status           state of a run directory: steps, checkpoints, job
  logs             print / follow logs (-c trainer|orchestrator|inference, --env NAME, -f, --search,
                   --regex, --level, --since)
  components       every process of a run: role, env, pid, node, state, restarts
  cancel           stop the job that owns a run directory
  checkpoints      list a run directory's checkpoints and their ids (for checkpoint_id / ckpt.warm_start)
  export           write HF weights (safetensors + config + tokenizer) from a checkpoint (STEP_DIR [--out DIR])
  plot             write PNG plots from a run's metrics.jsonl
  dashboard        web page over run directories: overview, metrics, rollouts, logs, configs (DIR ...)
  make-tiny-model  build a tiny Qwen3-style model (--preset tiny-moe: Qwen3-MoE) + tokenizer locally
  eval             score a model on environments: results.jsonl, avg@k / pass@k (ENV_ID -m MODEL -n N -r K)
  gepa             optimise an environment's system prompt with GEPA (run ENV_ID -m MODEL -B CALLS)
  prepare-resume   pin a run's configs to its newest complete checkpoint (run by SLURM jobs on requeue)

`hpcrl <command> --help` lists that command's flags. Config flags are dotted and kebab-case
(--orchestrator.batch-size 64, --trainer.optim.lr 3e-6, --ckpt, --no-wandb, --trainer @ t.toml).
"""


class UsageError(UserError):
    """A command-line mistake outside the config (one line, exit 2)."""


def _fail(msg: str) -> int:
    print(f"hpcrl: error: {msg}", file=sys.stderr)
    return 2


def _pop_flag(argv: list[str], name: str, takes_value: bool = True) -> str | bool | None:
    """Remove `--name V` / `--name=V` (or a bare `--name`) from argv; return its value."""
    for i, tok in enumerate(argv):
        if tok == name:
            if not takes_value:
                del argv[i]
                return True
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value")
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if takes_value and tok.startswith(name + "="):
            del argv[i]
            return tok.split("=", 1)[1]
    return None


def _int_flag(argv: list[str], name: str) -> int | None:
    v = _pop_flag(argv, name)
    if v is None:
        return None
    try:
        return int(str(v))
    except ValueError:
        raise UsageError(f"{name}: expected an integer, got '{v}'") from None


def _config_help(command: str, root_name: str = "Config") -> str:
    from hpcrl.config import fields, roles, schema

    root = getattr(schema, root_name)
    view = command if command in roles.VIEWS else None
    head = (
        "config flags:"
        if view is None
        else f"config flags (what `hpcrl {command}` reads; `hpcrl run` takes all):"
    )
    lines = [f"usage: hpcrl {command} [cfg.toml | @ a.toml @ b.toml] [flags]", "", head]
    for path, typ, desc, default in fields.iter_leaves(root):
        if view is not None and not roles.reads(view, path):
            continue
        flag = "--" + path.replace("_", "-")
        if typ == "section":
            if fields.resolve(root, path.split(".")).optional_section:  # --x enables it, --no-x removes it
                lines.append(f"  {flag} | --no-{flag[2:]}  [{desc or 'optional section'}]")
            else:
                lines.append(f"  [{path}]")
            continue
        dflt = "" if default in (None, [], {}) else f" (default: {default})"
        lines.append(f"  {flag} {typ}  {desc}{dflt}")
    return "\n".join(lines)


_COMMAND_FLAGS = {
    "run": "  --dry-run            resolve, validate, check the models, write <output_dir>/configs/, print a summary, exit\n"
    "  --dashboard          serve `hpcrl dashboard <output_dir>` beside the run (its URL is printed)",
    "submit": "  --nodes N  --partition P  --time T  --account A  --dry-run (renders sbatch, asks sbatch --test-only)",
    "resume": "  --step -1|N  --output-dir DIR  [--dry-run]  (plus any config flag, e.g. --max-steps 40)",
    "trainer": "  --dry-run            validate as the trainer reads it, check the model, print what it would start, exit",
    "orchestrator": "  --dry-run            validate as the orchestrator reads it, check its tokenizer's model, print a summary, exit",
    "inference": "  --run-dir DIR  --server-index N  (announce the server address in a run directory)\n"
    "  --dry-run            validate as the server reads it, check the model, print what it would serve, exit",
    "sft": "  --dry-run            resolve, validate, check model and data, write <output_dir>/configs/sft.toml, print a summary, exit",
    "eval": """  ENV_ID ...              environments to evaluate (built-in, verifiers module, module:function)
  -m MODEL                model: local dir, hub id, a run's weights/step_N, or a name at -b
  -n N  -r R              examples per env (-1 = all), rollouts per example (the k of avg@k / pass@k)
  -a JSON                 environment arguments, e.g. '{"difficulty": "hard", "system_prompt_file": "p.txt"}'
  -b URL                  any OpenAI-compatible endpoint (default: start `hpcrl inference` for MODEL)
  -t N  -T X              sampling.max_tokens, sampling.temperature
  --output-dir DIR        results.jsonl, summary.json (default: outputs/evals/<env>--<model>/<time>)
  --dry-run               validate, check the model (and tokenizer), print what it would run, exit""",
    "gepa": """  run ENV_ID              the environment whose system prompt is optimised (or [[env]] in @ cfg.toml)
  -m / --model MODEL      model for rollouts (as hpcrl eval); -b URL: an OpenAI-compatible endpoint
  -M / --reflection-model model that proposes prompts (default: MODEL)
  -B / --max-calls N      budget: scored rollouts, base evaluation included (strict)
  -n / --num-train N      -N / --num-val N      --minibatch-size N    --perfect-score X
  --state-columns a,b     task info keys (or answer, metrics) shown to the reflection model
  -a JSON  -t N  -T X     environment arguments, sampling.max_tokens, sampling.temperature
  --output-dir DIR        rerunning the same DIR resumes the search (default: outputs/gepa/<env>--<model>)""",
}


def _load(argv: list[str], root_name: str = "Config", require_envs: bool = True, role: str | None = None):
    from hpcrl.config import schema
    from hpcrl.launch.checks import load

    return load(argv, getattr(schema, root_name), require_envs=require_envs, role=role)


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------
def cmd_run(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    dashboard = bool(_pop_flag(argv, "--dashboard", takes_value=False))
    loaded = _load(argv)
    from hpcrl.launch import prepare, run_checks

    loaded.notes.extend(run_checks.run_notes(loaded.config))
    placement = prepare.local_plan(loaded)
    memory: list[str] = []
    if placement.uses_gpus:  # on GPUs: the per-GPU memory plan, refused when it cannot fit
        from hpcrl.launch.memory_plan import dry_run_lines

        memory = dry_run_lines(loaded.config, placement)
    from hpcrl.launch.host_memory import local_check

    memory += local_check(loaded.config, placement)  # every process on this machine: refused if it cannot fit
    prepare.apply_placement(loaded.config, placement)
    prepare.prepare_output_dir(loaded.config, dry_run=dry)
    if dry:
        from hpcrl.envs.verifiers.v1_runtime import dry_run_check as runtimes_can_start
        from hpcrl.render.select import dry_run_check

        runtimes_can_start(loaded.config)
        notes = dry_run_check(loaded.config)
        resume = run_checks.resume_line(loaded.config)  # --ckpt.resume-step: the checkpoint must be there
        prepare.print_summary(
            loaded, placement, "run (this machine)", [*([resume] if resume else []), *memory]
        )
        for note in notes:
            print(note)
        return 0
    from hpcrl.launch.local import run_local

    if not dashboard:
        return run_local(loaded, placement)
    from hpcrl.dashboard.serve import beside

    with beside(loaded.config.output_dir):
        return run_local(loaded, placement)


def cmd_submit(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    nodes = _int_flag(argv, "--nodes")
    for flag in ("--partition", "--time", "--account"):
        v = _pop_flag(argv, flag)
        if v is not None:
            argv += [f"--slurm.{flag[2:]}", str(v)]
    if "--slurm" not in argv and not any(a.startswith("--slurm.") for a in argv):
        argv.append("--slurm")
    from hpcrl.launch.sft_submit import is_sft_argv, submit_sft

    if is_sft_argv(argv):  # an SFT config (a [data] table): the same SLURM path, one component
        return submit_sft(_load(argv, "SFTConfig"), nodes=nodes, dry_run=dry)
    loaded = _load(argv)
    if loaded.config.slurm is None:
        from hpcrl.config.schema import SlurmConfig

        loaded.config.slurm = SlurmConfig()
    from hpcrl.launch.submit import submit

    return submit(loaded, nodes=nodes, dry_run=dry)


def cmd_prepare_resume(argv: list[str]) -> int:
    from hpcrl.launch.submit import prepare_resume_main

    return prepare_resume_main(argv)


def cmd_resume(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    step = _int_flag(argv, "--step")
    out = _pop_flag(argv, "--output-dir")
    if out is None:
        raise UsageError("resume needs --output-dir DIR (the run to continue)")
    from hpcrl.launch.resume import resume

    return resume(Path(str(out)), -1 if step is None else step, argv, dry_run=dry)


def _role_dry_run(loaded: Loaded, role: str, run_dir: str | None = None, server_index: int = 0) -> int:
    """`hpcrl trainer | orchestrator | inference --dry-run`: the config as the role reads it, the model
    checks and what it would start; writes and starts nothing."""
    from hpcrl.launch.prepare import print_role_summary

    print_role_summary(loaded, role, run_dir=run_dir, server_index=server_index)
    return 0


def cmd_trainer(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    loaded = _load(argv, role="trainer", require_envs=False)  # a trainer alone reads no env
    if dry:
        return _role_dry_run(loaded, "trainer")
    from hpcrl.trainer import parallel

    if loaded.config.trainer.data.fake is not None:  # the trainer alone on made-up batches
        from hpcrl.trainer.rl_fake import main
    else:
        from hpcrl.trainer.rl import main
    rc = main(loaded.config)
    if parallel.ran_distributed():  # see hard_exit
        parallel.hard_exit(rc)
    return rc


def cmd_orchestrator(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    loaded = _load(argv, role="orchestrator")
    if dry:
        return _role_dry_run(loaded, "orchestrator")
    from hpcrl.orchestrator.loop import main

    return main(loaded.config)


def cmd_inference(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    run_dir = _pop_flag(argv, "--run-dir")
    index = _int_flag(argv, "--server-index") or 0
    # A bare `hpcrl inference --model.name DIR` needs no training environments.
    loaded = _load(argv, require_envs=False, role="inference")
    if dry:
        return _role_dry_run(loaded, "inference", None if run_dir is None else str(run_dir), index)
    from hpcrl.inference.server import serve_config

    return serve_config(loaded.config, run_dir=None if run_dir is None else str(run_dir), server_index=index)


def cmd_sft(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    loaded = _load(argv, "SFTConfig")
    from hpcrl.launch.sft_submit import local_notes

    loaded.notes.extend(local_notes(loaded.config))  # [slurm] / num_train_nodes: for `hpcrl submit`
    if dry:
        from hpcrl.launch import prepare
        from hpcrl.render.select import dry_run_check

        prepare.prepare_output_dir(loaded.config, dry_run=True)
        notes = dry_run_check(loaded.config)
        prepare.print_sft_summary(loaded)
        for note in notes:
            print(note)
        return 0
    from hpcrl.launch.sft import main
    from hpcrl.trainer import parallel

    for note in loaded.notes if "RANK" not in os.environ else []:
        print(f"hpcrl sft: note: {note}", flush=True)
    rc = main(loaded.config)
    if parallel.ran_distributed():  # a rank (not the launcher of several ranks): see hard_exit
        parallel.hard_exit(rc)
    return rc


def cmd_status(argv: list[str]) -> int:
    from hpcrl.launch.manage import status

    return status(argv)


def cmd_logs(argv: list[str]) -> int:
    from hpcrl.launch.logview import logs

    return logs(argv)


def cmd_components(argv: list[str]) -> int:
    from hpcrl.launch.logview import components

    return components(argv)


def cmd_cancel(argv: list[str]) -> int:
    from hpcrl.launch.manage import cancel

    return cancel(argv)


def cmd_checkpoints(argv: list[str]) -> int:
    from hpcrl.warm_start import main

    return main(argv)


EXPORT_USAGE = """usage: hpcrl export STEP_DIR [--out DIR] [--dtype policy|master|bfloat16|float32|float16]

Write Hugging Face weights (safetensors + config.json + tokenizer) from a training checkpoint
(<run>/checkpoints/step_N), one tensor at a time, in bounded memory (one 1 GiB file + one tensor).
  --out DIR    default <run>/weights/step_N (where ckpt.hf_weights would have written them)
  --dtype D    policy (default: what the run published to inference) or master (the saved weights)"""


def cmd_export(argv: list[str]) -> int:
    if not argv or "-h" in argv or "--help" in argv:
        print(EXPORT_USAGE)
        return 0 if argv else 2
    from hpcrl.trainer.export import main

    return main(argv)


def cmd_plot(argv: list[str]) -> int:
    from hpcrl.monitor.plots import main

    return main(argv)


def cmd_dashboard(argv: list[str]) -> int:
    from hpcrl.dashboard.serve import main

    return main(argv)


def cmd_eval(argv: list[str]) -> int:
    dry = bool(_pop_flag(argv, "--dry-run", takes_value=False))
    from hpcrl.evaluation.args import EVAL_FLAGS, load_run, print_dry_run

    loaded = load_run(argv, _schema_root("EvalRunConfig"), EVAL_FLAGS)
    if dry:
        print_dry_run(loaded)
        return 0
    from hpcrl.evaluation.run import main

    return main(loaded.config)


def cmd_gepa(argv: list[str]) -> int:
    from hpcrl.evaluation.args import GEPA_FLAGS, load_run
    from hpcrl.evaluation.gepa_run import main

    return main(
        load_run(argv[1:] if argv[:1] == ["run"] else argv, _schema_root("GepaRunConfig"), GEPA_FLAGS).config
    )


def _schema_root(name: str) -> type:
    from hpcrl.config import schema

    return getattr(schema, name)


def cmd_make_tiny_model(argv: list[str]) -> int:
    from hpcrl.models.tiny import main

    return main(argv) or 0


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str | None]] = {
    "run": (cmd_run, "Config"),
    "submit": (cmd_submit, "Config"),
    "resume": (cmd_resume, "Config"),
    "trainer": (cmd_trainer, "Config"),
    "orchestrator": (cmd_orchestrator, "Config"),
    "inference": (cmd_inference, "Config"),
    "sft": (cmd_sft, "SFTConfig"),
    "status": (cmd_status, None),
    "logs": (cmd_logs, None),
    "components": (cmd_components, None),
    "cancel": (cmd_cancel, None),
    "checkpoints": (cmd_checkpoints, None),
    "export": (cmd_export, None),
    "plot": (cmd_plot, None),
    "dashboard": (cmd_dashboard, None),
    "make-tiny-model": (cmd_make_tiny_model, None),
    "eval": (cmd_eval, "EvalRunConfig"),
    "gepa": (cmd_gepa, "GepaRunConfig"),
    "prepare-resume": (cmd_prepare_resume, None),
}


# Commands that run for long with their output going to a log file: output the disk refuses (a full
# or read-only log) is dropped and counted, never ends them (hpcrl.storage.tolerate_std_streams). The
# others print what the user asked for: a write that fails fails the command, as it should.
LONG_RUNNING = ("run", "resume", "trainer", "orchestrator", "inference", "sft", "eval", "gepa", "dashboard")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from hpcrl import __version__

        print(f"hpcrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        from hpcrl.errors import nearest

        return _fail(f"unknown command '{name}'{nearest(name, COMMANDS)}; see `hpcrl --help`")
    fn, root = COMMANDS[name]
    if root is not None and ("-h" in rest or "--help" in rest):
        extra = _COMMAND_FLAGS.get(name)
        print(_config_help(name, root) + (f"\n\ncommand flags:\n{extra}" if extra else ""))
        return 0
    if name in LONG_RUNNING and "--dry-run" not in rest:  # a plan printed on request must be written
        from hpcrl.storage import tolerate_std_streams

        tolerate_std_streams()
    try:
        return user_errors(lambda: fn(rest))  # the one place a UserError becomes "one line, exit 2"
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
