"""The --dry-run memory plan of `hpcrl sft` (and `hpcrl submit` of an SFT config): a trainer rank,
and with [eval] the online evaluations' inference server, where hpcrl.trainer.sft_eval puts it.

    plan = sft_plan(cfg, SFTGpus(node=8, ranks=1, ranks_per_node=1))   # None: architecture unknown
    plan.lines(limit)      # the dry-run's rows
    plan.check(limit)      # ConfigError (one line, the field to change) when it cannot fit

A trainer rank: hpcrl.launch.memory_plan's rows (parameters, gradients, optimizer, gathered,
activations, logits) from [model], [optim] and micro_batch_tokens; no weight publish (SFT has no
inference servers to feed). Those rows count the text model; with [model.vlm] a "vision encoder" row
adds the vision tower's V parameters (hpcrl.models.arch.vision_param_count, from config.json's
vision_config). The whole model is built in the master dtype and FSDP-sharded, the vision tower in
the root group (hpcrl.models.parallelize.apply_fsdp wraps the language model's layers, never the
tower's blocks, even where the tower has more: Qwen2-VL-7B's and Qwen2.5-VL-7B's 32 blocks against
28 layers), which stays gathered from the forward through the backward:
  vision encoder  V / N x master bytes (its shard) + V x compute bytes (gathered whole); with
                  model.vlm.freeze_vision_encoder = false also its gradients, V / N x master bytes,
                  and optimizer state, V / N x master bytes x the optimizer's states (as the text
                  model's rows count them; 0 with the optimizer on the host)
and an "images" row adds the tower's activations for one micro-batch's images (patches from the
image processor's max_pixels and seq_len; saved for the backward when the tower trains, only the
forward's peak when frozen: hpcrl.launch.memory_vision, where the arithmetic is). Not counted: a
trained tower's unsharded gradients before their reduce-scatter at the end of the backward.

The evaluations' server (`hpcrl eval`'s own, started by rank 0 at each due step, beside training):
prime-rl puts it on deployment.num_infer_gpus GPUs (default 1) of its own beside
deployment.num_train_gpus, and refuses a node that cannot hold both. hpcrl gives it the
num_infer_gpus GPUs after the trainer ranks' on rank 0's node when they are free (`separate`), else
it starts on the trainer's first GPU(s) (`shared`: every GPU is a trainer rank's, e.g. SLURM's one
rank per GPU). Its GPU holds, as an inference GPU of memory_plan's: weights P x dtype bytes / tp, a
reserve, and the KV cache vLLM makes of eval.inference.gpu_memory_utilization x the GPU's memory.
  separate  its GPU must hold weights + reserve and at least one sequence of max_model_len in KV
            (eval.inference.max_model_len, else the eval's seq_len); eval.inference.tp must not exceed
            the GPUs it gets.
  shared    vLLM takes its fraction of the whole GPU up front, so a trainer rank's T GiB plus
            gpu_memory_utilization x the GPU's memory must fit the GPU; the refusal names
            deployment.num_train_gpus (a GPU of its own, prime-rl's layout) or the utilization that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError
from hpcrl.launch.memory_plan import OPTIMIZER_STATES, check_trainer, trainer_items, trainer_kw
from hpcrl.launch.memory_sync import inference_items
from hpcrl.launch.memory_units import BYTES, SHORT, Item
from hpcrl.launch.memory_units import count as _count
from hpcrl.models.arch import Arch, find_arch

if TYPE_CHECKING:
    from hpcrl.config.schema import SFTConfig


@dataclass(frozen=True)
class SFTGpus:
    """The GPUs an SFT run is planned on: a node's GPUs, the trainer ranks, how many on rank 0's node."""

    node: int
    ranks: int
    ranks_per_node: int
    local: bool = True  # `hpcrl sft` (deployment.num_train_gpus picks the ranks); False: SLURM, one per GPU


@dataclass
class EvalServer:
    gpus: list[str] | None  # its own GPUs (after the trainer ranks'); None: the trainer's first ones
    tp: int
    dtype: str
    items: list[Item]
    kv_tokens: int
    max_model_len: int
    utilization: float
    head: str

    @property
    def gib(self) -> float:
        return sum(i.gib for i in self.items)


@dataclass
class SFTMemoryPlan:
    model: str
    arch: Arch
    gpus: SFTGpus
    trainer: list[Item]
    trainer_head: str
    ac: bool
    ac_other_gib: float
    server: EvalServer | None
    vision_trained_gib: float = 0.0  # a trained vision encoder's gradients + optimizer state + saved images

    @property
    def trainer_gib(self) -> float:
        return sum(i.gib for i in self.trainer)

    def lines(self, limit_gib: float) -> list[str]:
        a = self.arch
        vision = f" + {_count(a.vision_params)} in the vision encoder" if a.vision_params else ""
        out = [f"memory plan:  {self.model}: {_count(a.params)} params{vision}; numbers from {a.source}"]
        out.append(f"  trainer rank ({self.trainer_head}): {self.trainer_gib:.1f} GiB of {limit_gib:g} GiB")
        out += [i.row() for i in self.trainer]
        s = self.server
        if s is not None:
            out.append(f"  online eval server ({s.head}): {s.gib:.1f} GiB of {limit_gib:g} GiB")
            out += [i.row() for i in s.items]
        return out

    def check(self, limit_gib: float) -> None:
        try:
            check_trainer(
                self.trainer, limit_gib, moe=self.arch.moe, ac=self.ac, ac_other_gib=self.ac_other_gib,
                ranks_field="deployment.num_train_gpus", model_field="model",
            )  # fmt: skip
        except ConfigError as e:
            if not self.vision_trained_gib:
                raise
            raise ConfigError(
                e.path,
                f"{e.message}; model.vlm.freeze_vision_encoder = true saves the vision encoder's "
                f"gradients, optimizer state and saved image activations ({self.vision_trained_gib:.1f} GiB)",
            ) from None
        s = self.server
        if s is None:
            return
        if s.gpus is not None and s.tp > len(s.gpus):
            raise ConfigError(
                "deployment.num_infer_gpus",
                f"the online evals' inference server has eval.inference.tp = {s.tp} but gets {len(s.gpus)} "
                f"GPU(s): deployment.num_infer_gpus = {s.tp}, or a lower eval.inference.tp",
            )
        if s.gpus is None:
            self._check_shared(limit_gib)
        if s.kv_tokens < s.max_model_len:
            weights = sum(i.gib for i in s.items if i.name != "KV cache")
            field = (
                "eval.inference.tp"
                if weights >= s.utilization * limit_gib
                else "eval.inference.max_model_len"
            )
            raise ConfigError(
                field,
                f"the online evals' inference server ({s.head}) keeps {max(s.kv_tokens, 0)} tokens of KV "
                f"cache on {limit_gib:g} GiB GPUs, less than one sequence of max_model_len {s.max_model_len}: "
                "raise eval.inference.tp (with deployment.num_infer_gpus) or "
                "eval.inference.gpu_memory_utilization, lower eval.inference.max_model_len, or raise "
                "deployment.gpu_memory_gib",
            )

    def _check_shared(self, limit_gib: float) -> None:
        """vLLM takes gpu_memory_utilization x the GPU at start: beside a trainer rank it must fit."""
        s = self.server
        assert s is not None and s.gpus is None
        pool, trainer = s.utilization * limit_gib, self.trainer_gib
        if trainer + pool <= limit_gib + 1e-9:
            return
        g = self.gpus
        head = (
            f"the online evals' inference server shares the trainer's GPU (all {g.node} GPU(s) of the node "
            f"are trainer ranks'): eval.inference.gpu_memory_utilization {s.utilization:g} x {limit_gib:g} GiB "
            f"= {pool:.1f} GiB beside a trainer rank's {trainer:.1f} GiB does not fit"
        )
        own = g.node - max(s.tp, 1)  # trainer GPUs that leave the server tp of its own
        util = int((limit_gib - trainer) / limit_gib * 100) / 100
        _, kv_tokens = inference_items(
            self.arch, tp=s.tp, dtype=s.dtype, limit_gib=limit_gib, utilization=max(util, 0.01)
        )
        fits = util > 0 and kv_tokens >= s.max_model_len
        fixes = []
        if own >= 1 and g.local:  # one machine: fewer ranks free GPUs for it
            fixes.append(
                (
                    "deployment.num_train_gpus",
                    f"deployment.num_train_gpus = {own} (its own GPU, prime-rl's num_infer_gpus layout)",
                )
            )
        if fits:
            fixes.append(
                (
                    "eval.inference.gpu_memory_utilization",
                    f"eval.inference.gpu_memory_utilization <= {util:.2f}",
                )
            )
        fixes.append(("deployment.gpu_memory_gib", "raise deployment.gpu_memory_gib"))
        said = ", ".join(f for _, f in fixes[:-1]) + ", or " if len(fixes) > 1 else ""
        raise ConfigError(fixes[0][0], f"{head}: {said}{fixes[-1][1]}")


def eval_max_model_len(cfg: SFTConfig) -> int:
    """The evaluations' server's context: eval.inference.max_model_len, else the eval's seq_len (as
    hpcrl.trainer.sft_eval.eval_run_dict hands `hpcrl eval`)."""
    ev = cfg.eval
    assert ev is not None
    return ev.inference.max_model_len or ev.seq_len or cfg.data.seq_len or cfg.seq_len


def sft_plan(cfg: SFTConfig, gpus: SFTGpus, limit_gib: float | None = None) -> SFTMemoryPlan | None:
    """The memory plan of `cfg` on `gpus` (see the module docstring); None when the model's
    architecture is unknown here."""
    from hpcrl.launch.checks import trainer_precision
    from hpcrl.trainer.sft_eval import eval_devices

    arch = find_arch(cfg.model.name or "")
    if arch is None:
        return None
    limit = limit_gib or cfg.deployment.gpu_memory_gib
    prec = trainer_precision(cfg, on_gpu=True)
    ranks = gpus.ranks
    kw = trainer_kw(
        cfg.model, arch, ranks=ranks, tokens=max(cfg.micro_batch_tokens, cfg.data.seq_len or cfg.seq_len),
        prec=prec, optimizer=cfg.optim.type,
    )  # fmt: skip
    ac = getattr(cfg.model, "ac", None) is not None
    trainer = trainer_items(arch, ac=ac, **kw)
    other = next(i.gib for i in trainer_items(arch, ac=not ac, **kw) if i.name == "activations")
    from hpcrl.launch.memory_vision import vlm_rows

    trained = vlm_rows(
        trainer, arch, getattr(cfg.model, "vlm", None), kw, name=cfg.model.name,
        seq_len=cfg.data.seq_len or cfg.seq_len, states=OPTIMIZER_STATES.get(kw["optimizer"], 0),
    )  # fmt: skip
    server = None
    if cfg.eval is not None:
        inf = cfg.eval.inference
        own = eval_devices(
            [str(i) for i in range(gpus.node)], gpus.ranks_per_node, cfg.deployment.num_infer_gpus
        )
        dtype = inf.dtype if inf.dtype in BYTES else "bfloat16"  # auto: bf16 on GPU
        items, kv_tokens = inference_items(
            arch, tp=inf.tp, dtype=dtype, limit_gib=limit, utilization=inf.gpu_memory_utilization
        )
        where = f"GPU {','.join(own)} of its own" if own else "on the trainer's GPU, shared"
        server = EvalServer(
            gpus=own, tp=inf.tp, dtype=dtype, items=items, kv_tokens=kv_tokens, max_model_len=eval_max_model_len(cfg),
            utilization=inf.gpu_memory_utilization,
            head=f"{where}; tp {inf.tp}, {SHORT[dtype]}, gpu_memory_utilization {inf.gpu_memory_utilization:g}",
        )  # fmt: skip
    cp = int(getattr(cfg.model, "cp", 1) or 1)
    parallel = f"FSDP {ranks}" + (f", cp {cp}" if cp > 1 else "")
    return SFTMemoryPlan(
        model=cfg.model.name or "", arch=arch, gpus=gpus, trainer=trainer,
        trainer_head=f"{ranks} ranks, {parallel}; {SHORT[prec.compute]} compute, {SHORT[prec.master]} master",
        ac=ac, ac_other_gib=other, server=server, vision_trained_gib=trained,
    )  # fmt: skip


def local_gpus(cfg: SFTConfig, visible: int) -> SFTGpus:
    """`hpcrl sft` on this machine: its visible GPUs (none: a node of deployment.gpus_per_node, for the
    information), the ranks hpcrl.launch.sft_ranks.requested_ranks starts there."""
    d = cfg.deployment
    node = visible or d.gpus_per_node
    ranks = d.num_trainer_ranks or d.num_train_gpus or max(1, node)
    return SFTGpus(node=node, ranks=ranks, ranks_per_node=ranks)


def dry_run_lines(cfg: SFTConfig, gpus: SFTGpus, on_gpu: bool) -> list[str]:
    """The plan's lines for the dry-run summary; on GPU compute it refuses (ConfigError) what cannot
    fit deployment.gpu_memory_gib, on CPU it only informs."""
    plan = sft_plan(cfg, gpus)
    if plan is None:
        return [
            f"memory plan:  skipped: no architecture numbers for {cfg.model.name!r} (not a local directory, "
            "not in the HF cache, not in hpcrl.models.arch.KNOWN)"
        ]
    limit = cfg.deployment.gpu_memory_gib
    if on_gpu and cfg.deployment.compute != "cpu":
        plan.check(limit)
        return plan.lines(limit)
    return plan.lines(limit) + [
        f"  note:       CPU compute: the plan is information, not checked (as on {gpus.node} GPU(s) a node)"
    ]
