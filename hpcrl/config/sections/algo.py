"""[orchestrator.algo]: the training algorithm, prime-rl's discriminated union on `type`.

One table with every algorithm's fields; `type` picks the algorithm and a field of another type set
to anything but its default is an error (hpcrl.config.validate), as prime-rl's union rejects it.
Each type fixes which model samples (`sampling.source`) and which loss the sampled tokens feed:

    grpo, max_rl, rae, echo   rl      advantage from rewards (orchestrator), policy-gradient loss
    opd, opsd                 ref_kl  reference logprobs per token (orchestrator), reverse KL
    sft                       ce      a frozen model samples, cross entropy on its tokens

hpcrl's older keys set this table (OrchestratorConfig.__post_init__): `training_mode` = its type
(rl = grpo), `[orchestrator.teacher]` = `teacher` (opd) or `sampling.source` (sft), and
`orchestrator.advantage.length_penalty = c` = a linear penalty on output tokens alone.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import RendererConfig

AlgoType = Literal["grpo", "max_rl", "rae", "hierarchical_grpo", "opd", "opsd", "sft", "echo"]
ActionLoss = Literal["rl", "ref_kl", "ce"]

# Which loss each type's sampled tokens feed (prime-rl's action_loss_type).
ACTION_LOSS: dict[str, ActionLoss] = {
    "grpo": "rl",
    "max_rl": "rl",
    "rae": "rl",
    "hierarchical_grpo": "rl",
    "echo": "rl",
    "opd": "ref_kl",
    "opsd": "ref_kl",
    "sft": "ce",
}
# The trainer's loss mode (hpcrl.trainer.loss.LossParams.mode) of each action loss.
LOSS_MODE = {"rl": "rl", "ref_kl": "opd", "ce": "sft"}

OPSD_TEMPLATE = (
    "Here is an example of an expert response:\n<demonstration>\n{demonstration}\n</demonstration>"
)


class FrozenModelConfig(Section):
    """A model hpcrl does not train or host: an OpenAI-compatible endpoint (prime-rl's FrozenModelConfig)."""

    base_url: Annotated[str, D("OpenAI-compatible endpoint of the model (required: hpcrl never starts it).")]
    name: Annotated[
        str | None, D("Served model name, sent as `model` of every request (unset: the server's own).")
    ] = None
    api_key_var: Annotated[str, D("Environment variable holding the endpoint's API key.")] = "VLLM_API_KEY"


class AlgoSamplingConfig(Section):
    source: Annotated[
        Literal["policy"] | FrozenModelConfig,
        D(
            "Who samples the training rollouts: 'policy' (the live policy) or a frozen model "
            "(a table: name, base_url, api_key_var), which only type = 'sft' accepts."
        ),
    ] = "policy"


class LengthPenaltyConfig(Section):
    """Linear length penalty (grpo, echo): each reward minus pass_rate x (the three terms below, each
    a quantity over the group's max of it), before the group baseline."""

    type: Annotated[Literal["linear"], D("The penalty's shape (only linear).")] = "linear"
    num_output_tokens_weight: Annotated[
        float, D("Weight of completion tokens / the group's max completion tokens (0 = off).", ge=0)
    ] = 0.25
    num_input_tokens_weight: Annotated[
        float,
        D(
            "Weight of tokens conditioned on, not sampled (prompt, tool output) / the group's max (0 = off).",
            ge=0,
        ),
    ] = 0.1
    num_turns_weight: Annotated[float, D("Weight of turns / the group's max turns (0 = off).", ge=0)] = 0.1


class EchoRoleConfig(Section):
    alpha: Annotated[
        float, D("Cross-entropy weight of this role's env-provided tokens (ECHO's lambda).", gt=0)
    ] = 0.1


class EchoRolesConfig(Section):
    """Env-provided message roles echo trains on; setting any role replaces the whole table."""

    system: EchoRoleConfig | None = None
    user: EchoRoleConfig | None = None
    assistant: EchoRoleConfig | None = None
    tool: EchoRoleConfig | None = None


class EchoFilterConfig(Section):
    import_path: Annotated[
        str,
        D(
            "A callable narrowing echo's tokens: filter(rollout, **kwargs) -> one keep-mask (list of "
            "bool) per training sequence of the rollout, each as long as its tokens."
        ),
    ]
    kwargs: Annotated[dict[str, Any], D("Keyword arguments of the filter.")] = msgspec.field(
        default_factory=dict
    )


def _echo_roles() -> EchoRolesConfig:
    return EchoRolesConfig(tool=EchoRoleConfig())


class AlgoConfig(Section):
    type: Annotated[
        AlgoType,
        D(
            "grpo (reward - group mean); max_rl ((reward - mean) / mean); rae (reward - per-agent EMA "
            "baseline); opd (reverse KL to a frozen teacher); opsd (reverse KL to the policy shown a "
            "demonstration); sft (a frozen model samples, cross entropy); echo (grpo + weighted cross "
            "entropy on env-provided tokens of later turns, by message role); hierarchical_grpo "
            "(proposer-solver envs) is not implemented here."
        ),
    ] = "grpo"
    sampling: AlgoSamplingConfig = msgspec.field(default_factory=AlgoSamplingConfig)
    length_penalty: Annotated[
        LengthPenaltyConfig | None, D("grpo / echo: linear length penalty (unset = off).")
    ] = None
    decay: Annotated[
        float, D("rae: EMA decay of each agent's baseline (b <- decay b + (1 - decay) reward).", ge=0, lt=1)
    ] = 0.95
    episode_agents: Annotated[
        list[str] | None, D("hierarchical_grpo: roles compared within one proposed problem.")
    ] = None
    teacher: Annotated[
        FrozenModelConfig | None, D("opd: the frozen teacher (name, base_url, api_key_var); required.")
    ] = None
    demo_key: Annotated[
        str, D("opsd: the demonstration's key in the task's info, else a task field (e.g. answer).")
    ] = "demonstration"
    template: Annotated[
        str, D("opsd: the leading system message that carries the demonstration ({demonstration}).")
    ] = OPSD_TEMPLATE
    renderer: Annotated[
        RendererConfig | None,
        D("opsd: renderer of the demonstration's system message (unset: orchestrator.renderer)."),
    ] = None
    roles: Annotated[
        EchoRolesConfig,
        D("echo: roles whose env-provided tokens train with cross entropy (default: tool, 0.1)."),
    ] = msgspec.field(default_factory=_echo_roles)
    filter: Annotated[EchoFilterConfig | None, D("echo: a callable narrowing the role-selected tokens.")] = (
        None
    )

    @property
    def action_loss(self) -> ActionLoss:
        return ACTION_LOSS[self.type]

    @property
    def loss_mode(self) -> str:
        """The trainer's loss mode for this algorithm: rl, opd (reverse KL) or sft (cross entropy)."""
        return LOSS_MODE[self.action_loss]

    @property
    def frozen(self) -> FrozenModelConfig | None:
        """The frozen endpoint this algorithm talks to: opd's teacher, or sft's sampling source."""
        if self.type == "opd":
            return self.teacher
        src = self.sampling.source
        return src if isinstance(src, FrozenModelConfig) else None


# Fields that belong to some types only: (field, the types that take it). Set to anything but the
# default under another type, they are refused (validate.algo), never silently ignored.
TYPE_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("length_penalty", ("grpo", "echo")),
    ("decay", ("rae",)),
    ("episode_agents", ("hierarchical_grpo",)),
    ("teacher", ("opd",)),
    ("demo_key", ("opsd",)),
    ("template", ("opsd",)),
    ("renderer", ("opsd",)),
    ("roles", ("echo",)),
    ("filter", ("echo",)),
)
