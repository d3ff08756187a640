"""The orchestrator as a real process against a real inference server, with a fake trainer.

The test plays the trainer: it publishes PolicyReady(0) (checksum of the tiny model's tensors),
reads the TrainBatches of steps 1 and 2 from the bus, checks them, and publishes the next policies
(same weights) so that the orchestrator finishes and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcrl.bus import Bus, PolicyReady, TrainBatch
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.conftest import InferenceServer, rl_toml
from tests.vf_classic import classic_verifiers

CONFIG = rl_toml(
    "{max_steps}",
    seq_len=256,
    model="{model}",
    batch_size=8,
    max_tokens=12,
    top='output_dir = "{run}"\ndeterministic = {deterministic}\n',
    orchestrator="max_async_level = 1\nmax_concurrent = 16\nrequest_timeout_s = 60\npolicy_timeout_s = 60\n",
    tables='args = {{ num_examples = 50 }}\n[trainer.broadcast]\ntransport = "filesystem"\n'
    '[deployment]\nnum_inference_servers = 1\n[orchestrator.advantage]\nzero_advantage = "keep"\n',
)

# Eval on the base model (step 0) and every 2 steps, 4 examples x 2 rollouts.
EVAL = (
    "--orchestrator.eval.interval",
    "2",
    "--orchestrator.eval.num-examples",
    "4",
    "--orchestrator.eval.rollouts-per-example",
    "2",
    "--orchestrator.eval.env",
    '[{id = "reverse-text", name = "rev"}]',
)

REQUIRED_METRICS = (
    "reward/all/mean",
    "reward/all/std",
    "reward/reverse-text/mean",
    "seq_len/all/mean",
    "is_truncated/all/mean",
    "num_turns/all/mean",
    "empty_rollouts/all",
    "errored_rollouts/all",
    "off_policy/mean",
    "off_policy/dropped",
    "filter/easy_dropped",
    "filter/hard_dropped",
    "time/wait_for_policy",
    "time/generate",
    "perf/samples_per_s",
)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One server for the module (its weights end up changed: the mismatch test runs last)."""
    srv = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("orch_server"))
    yield srv
    srv.stop()


def announce(server: InferenceServer, run: Path) -> None:
    """Make the module's server known to the run in `run` (as a launcher-started one would be)."""
    src = RunPaths(server.run_dir).server_file(0)
    dst = RunPaths(run).server_file(0)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())


def model_checksum(model_dir: Path) -> tuple[str, int, int]:
    from safetensors.torch import load_file

    from hpcrl.weights.checksum import state_dict_checksum

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return state_dict_checksum(tensors), sum(t.numel() for t in tensors.values()), nbytes


def start_orchestrator(
    run: Path, model: Path, max_steps: int = 2, deterministic: bool = False, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    cfg = run / "orch.toml"
    cfg.write_text(
        CONFIG.format(run=run, model=model, max_steps=max_steps, deterministic=str(deterministic).lower())
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    log = open(run / "orchestrator.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "hpcrl.cli", "orchestrator", "@", str(cfg), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def check_batch(batch: TrainBatch, step: int, prompt_ids_end: list[int]) -> None:
    assert (batch.step, batch.rank, batch.world_size) == (step, 0, 1)
    assert batch.num_samples == 8 and set(batch.env_names) == {"reverse-text"}
    assert batch.total_loss_tokens == batch.num_loss_tokens > 0
    assert np.all((batch.example_ids >= 0) & (batch.example_ids < 50))
    offsets = batch.sample_offsets()
    per_example: dict[int, list[float]] = {}
    for i in range(batch.num_samples):
        a, b = offsets[i], offsets[i + 1]
        mask, ids = batch.loss_mask[a:b], batch.input_ids[a:b]
        first = int(np.argmax(mask))
        assert mask.any() and mask[first:].all(), "single turn: the loss mask is exactly the completion"
        # Everything before the completion is prompt, ending with the generation prompt.
        assert ids[:first].tolist()[-len(prompt_ids_end) :] == prompt_ids_end
        assert np.array_equal(batch.position_ids[a:b], np.arange(b - a))
        lp = batch.inference_logprobs[a:b]
        assert np.all(np.isfinite(lp)) and np.all(lp[mask] <= 0) and np.all(lp[~mask] == 0)
        adv = batch.advantages[a:b]
        assert np.all(adv == adv[0])
        per_example.setdefault(int(batch.example_ids[i]), []).append(float(adv[0]))
        assert max(0, step - 2) <= batch.policy_versions[i] <= step - 1  # max_async_level = 1
    for advs in per_example.values():
        assert len(advs) == 4 and abs(sum(advs)) < 1e-4, advs


@pytest.mark.timeout(180)
def test_orchestrator_publishes_valid_batches(
    tiny_model_dir: Path, run_dir: Path, server: InferenceServer
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gen_prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    checksum, nparams, nbytes = model_checksum(tiny_model_dir)
    announce(server, run_dir)
    orch = start_orchestrator(run_dir, tiny_model_dir, extra=EVAL)
    paths = RunPaths(run_dir)
    bus = Bus(paths, role="trainer", rank=0, timeout=90)
    try:

        def policy(step: int) -> None:
            bus.publish_policy(
                PolicyReady(
                    step=step,
                    transport="filesystem",
                    path=str(tiny_model_dir),
                    checksum=checksum,
                    num_params=nparams,
                    num_bytes=nbytes,
                )
            )

        policy(0)
        for step in (1, 2):
            check_batch(bus.wait_batch(step, 0), step, gen_prompt)
            policy(step)
        assert orch.wait(timeout=60) == 0, (run_dir / "orchestrator.out").read_text()[-3000:]
    finally:
        if orch.poll() is None:
            orch.kill()
        bus.close()
    lines = [json.loads(x) for x in paths.prompts_log.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(len(x["example_ids"]) == 2 for x in lines)
    records = [r for r in read_metrics(paths.metrics_file) if r["role"] == "orchestrator"]
    assert [r["step"] for r in records if "reward/all/mean" in r] == [1, 2]
    evals = {r["step"]: r for r in read_metrics(paths.metrics_file) if "eval/rev/avg@2" in r}
    assert sorted(evals) == [0, 2] and all(0 <= evals[s]["eval/rev/pass@2"] <= 1 for s in evals)
    records = [r for r in records if "reward/all/mean" in r]
    for r in records:
        missing = [k for k in REQUIRED_METRICS if k not in r]
        assert not missing, missing
        assert r["errored_rollouts/all"] == 0 and r["off_policy/dropped"] == 0


def run_one_step(model_dir: Path, run_dir: Path, server: InferenceServer, *flags: str) -> TrainBatch:
    """Run the orchestrator for one step against the module's server (a fake trainer publishes the
    unchanged tiny model as policies 0 and 1) and return the published batch."""
    checksum, nparams, nbytes = model_checksum(model_dir)
    announce(server, run_dir)
    orch = start_orchestrator(run_dir, model_dir, max_steps=1, extra=flags)
    bus = Bus(RunPaths(run_dir), role="trainer", rank=0, timeout=90)
    try:
        for step in (0, 1):
            bus.publish_policy(
                PolicyReady(
                    step=step,
                    transport="filesystem",
                    path=str(model_dir),
                    checksum=checksum,
                    num_params=nparams,
                    num_bytes=nbytes,
                )
            )
            if step == 0:
                batch = bus.wait_batch(1, 0)
        assert orch.wait(timeout=60) == 0, (run_dir / "orchestrator.out").read_text()[-3000:]
    finally:
        if orch.poll() is None:
            orch.kill()
        bus.close()
    return batch


@pytest.mark.timeout(180)
def test_opd_carries_teacher_logprobs(tiny_model_dir: Path, run_dir: Path, server: InferenceServer) -> None:
    """training_mode = opd with the policy's own server as teacher: the teacher's logprobs of the
    sampled tokens must equal the sampler's (same weights)."""
    batch = run_one_step(
        tiny_model_dir,
        run_dir,
        server,
        "--orchestrator.training-mode",
        "opd",
        "--orchestrator.teacher.base-url",
        server.base_url,
    )
    assert batch.teacher_logprobs is not None
    m = batch.loss_mask
    assert np.allclose(batch.teacher_logprobs[m], batch.inference_logprobs[m], atol=1e-3)
    assert np.all(batch.teacher_logprobs[m] <= 0)


@pytest.mark.timeout(180)
def test_verifiers_env_runs_against_our_server(
    tiny_model_dir: Path, run_dir: Path, server: InferenceServer
) -> None:
    """A classic verifiers environment, unchanged, through the adapter against the real server."""
    classic_verifiers()
    env = '[{id = "tests.integration.vf_env_fixture:load_environment", name = "vf-reverse"}]'
    batch = run_one_step(tiny_model_dir, run_dir, server, "--orchestrator.train.env", env)
    assert set(batch.env_names) == {"vf-reverse"} and batch.num_samples == 8
    m = batch.loss_mask
    assert m.any() and np.all(batch.inference_logprobs[m] < 0) and np.all(batch.inference_logprobs[~m] == 0)
    records = [r for r in read_metrics(RunPaths(run_dir).metrics_file) if "reward/vf-reverse/mean" in r]
    assert records and records[0]["errored_rollouts/all"] == 0


# -- checkpoint + resume -----------------------------------------------------------------------
class FakeTrainer:
    """Publishes policies (always the tiny model's weights) and writes the trainer part of due
    checkpoints, like hpcrl.trainer would."""

    def __init__(self, run: Path, model: Path):
        self.paths, self.model = RunPaths(run), model
        self.checksum, self.nparams, self.nbytes = model_checksum(model)
        self.bus = Bus(self.paths, role="trainer", rank=0, timeout=90)

    def policy(self, step: int) -> None:
        self.bus.publish_policy(
            PolicyReady(
                step=step,
                transport="filesystem",
                path=str(self.model),
                checksum=self.checksum,
                num_params=self.nparams,
                num_bytes=self.nbytes,
            )
        )

    def batch(self, step: int) -> bytes:
        self.bus.wait_batch(step, 0)
        return self.paths.rollout_file(step, 0).read_bytes()

    def checkpoint(self, step: int) -> None:
        from hpcrl import checkpoint

        checkpoint.begin_part(self.paths, step, "trainer")
        (self.paths.trainer_ckpt_dir(step) / "state.json").write_text("{}")
        checkpoint.mark_part_done(self.paths, step, "trainer", rank=0)
        assert checkpoint.finalize_when_ready(self.paths, step, checkpoint.PARTS, 1, timeout=60) is not None

    def close(self) -> None:
        self.bus.close()


CKPT = ("--ckpt.interval", "2")
ASYNC2 = ("--orchestrator.max-async-level", "2")


def run_uninterrupted(
    run: Path, model: Path, steps: int, start: int = 0, extra: tuple[str, ...] = ()
) -> dict[int, bytes]:
    """Orchestrator from `start` (0, or a resumed checkpoint) to `steps` against a fake trainer;
    returns the published batch files by step."""
    orch = start_orchestrator(run, model, max_steps=steps, deterministic=True, extra=(*CKPT, *extra))
    trainer = FakeTrainer(run, model)
    out = {}
    try:
        trainer.policy(start)  # a resumed trainer re-announces its start policy
        for s in range(start + 1, steps + 1):
            out[s] = trainer.batch(s)
            trainer.policy(s)
        assert orch.wait(timeout=60) == 0, (run / "orchestrator.out").read_text()[-3000:]
    finally:
        if orch.poll() is None:
            orch.kill()
        trainer.close()
    return out


def prompts(run: Path) -> list[tuple[int, list[int]]]:
    return [
        (x["step"], x["example_ids"])
        for x in map(json.loads, RunPaths(run).prompts_log.read_text().splitlines())
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_continues_the_same_prompts_and_batches(
    tiny_model_dir: Path, tmp_path: Path, server: InferenceServer
) -> None:
    """Kill the orchestrator after checkpoint 2, resume from it: the same prompts in the same order,
    none skipped or repeated, and (deterministic mode) the same batch bytes as an uninterrupted run."""
    steps = 4
    ref_run, run = tmp_path / "ref", tmp_path / "run"
    for r in (ref_run, run):
        RunPaths(r).make_dirs()
        announce(server, r)
    reference = run_uninterrupted(ref_run, tiny_model_dir, steps, extra=ASYNC2)

    orch = start_orchestrator(
        run, tiny_model_dir, max_steps=steps, deterministic=True, extra=(*CKPT, *ASYNC2)
    )
    trainer = FakeTrainer(run, tiny_model_dir)
    got = {}
    try:
        trainer.policy(0)
        got[1] = trainer.batch(1)
        trainer.policy(1)
        # max_async_level 2: batch 3 needs only policy 1, so it is out before policy 2 exists. The
        # orchestrator writes its part of checkpoint 2 at the first step boundary after it sees
        # policy 2, which is therefore after batch 3: checkpoint 2 always holds batch 3 as pending.
        # (With level 1, batch 3 needed policy 2, and whether the part was written before or after
        # batch 3 depended on which process was faster.)
        got[2] = trainer.batch(2)
        got[3] = trainer.batch(3)
        trainer.policy(2)
        trainer.checkpoint(2)  # returns once the orchestrator's part is done too
        orch.kill()
        orch.wait()
    finally:
        trainer.close()
    # The batches checkpoint 2 saved as pending (published, not yet trained) must be re-published
    # byte for byte; a batch published after that boundary is regenerated (new created_at).
    pending = json.loads((RunPaths(run).orchestrator_ckpt_dir(2) / "state.json").read_text())["pending_steps"]
    assert 3 in pending, f"checkpoint 2 must hold batch 3 as pending, holds {pending}"
    before = {s: RunPaths(run).rollout_file(s, 0).read_bytes() for s in pending}
    Bus(RunPaths(run), role="launcher", listen=False).move_aside_after(2, tag="resume_test")

    got.update(
        run_uninterrupted(run, tiny_model_dir, steps, start=2, extra=(*ASYNC2, "--ckpt.resume-step", "2"))
    )
    assert prompts(run) == prompts(ref_run)
    ids = [i for _, step_ids in prompts(run) for i in step_ids]
    assert len(ids) == len(set(ids)) == steps * 2  # 50 tasks: nothing repeats within one epoch
    for s, data in before.items():  # batches published before the kill and re-published: same bytes
        assert got[s] == data
    for s in range(1, steps + 1):
        # Same tokens, masks, advantages, ids. Logprobs may differ in the last bits: the hf engine's
        # logits depend on which requests share a decode batch (float reassociation), so two runs
        # are byte-identical only on a batch-invariant server.
        assert not diff(got[s], reference[s]), (
            f"batch {s} differs from the uninterrupted run: {diff(got[s], reference[s])}"
        )


def diff(a: bytes, b: bytes, logprob_atol: float = 1e-4) -> list[str]:
    from hpcrl.bus import decode

    x, y = decode(a, TrainBatch), decode(b, TrainBatch)
    out = []
    for f in TrainBatch.__struct_fields__:
        u, v = getattr(x, f), getattr(y, f)
        if f == "inference_logprobs":
            same = np.allclose(u, v, rtol=0, atol=logprob_atol)
        else:
            same = np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v
        if not same:
            out.append(
                f"{f}: {u if not isinstance(u, np.ndarray) else u[:40]} != "
                f"{v if not isinstance(v, np.ndarray) else v[:40]}"
            )
    return out


@pytest.mark.timeout(120)
def test_multi_turn_rollouts_are_stitched_from_sampled_ids(
    tiny_model_dir: Path, server: InferenceServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """alphabet-sort against the real server: turn k>1 prompts are the previous prompt + sampled
    ids + the env's messages, so each rollout is one sequence whose loss mask covers exactly the
    sampled tokens (equality with the chat template is checked in tests/unit/test_orchestrator.py)."""
    import asyncio

    from transformers import AutoTokenizer

    from hpcrl.envs import load_environment
    from hpcrl.orchestrator.rollout import Generator, RolloutClient, ServerPool

    # The untrained tiny model almost never ends its turn, and a truncated turn ends the rollout:
    # report every turn as finished so the env answers and the next turn is stitched.
    chat = RolloutClient.chat

    async def finished_chat(self, *a, **kw):
        turn = await chat(self, *a, **kw)
        turn.finish_reason = "stop"
        return turn

    monkeypatch.setattr(RolloutClient, "chat", finished_chat)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = load_environment("alphabet-sort", min_turns=2, max_turns=3)
    tasks = list(env.tasks("train")[:2])

    async def go():
        pool = ServerPool([server.base_url], model=str(tiny_model_dir), timeout=60, max_concurrent=8)
        try:
            gen = Generator(pool, tok, 1024, lambda: 0, seed=3)
            return await gen.groups(env, tasks, 2, {"max_tokens": 8, "temperature": 1.0}, "t")
        finally:
            await pool.aclose()

    groups = asyncio.run(go())
    multi = [r for g in groups for r in g if r.num_turns > 1]
    assert all(not r.errored for g in groups for r in g) and multi
    for r in multi:
        assert len(r.pieces) == 1, "every turn extended the previous one exactly"
        p = r.pieces[0]
        assert sum(p.loss_mask) == r.completion_tokens
        lps = np.asarray(p.logprobs)
        assert np.all(lps[np.asarray(p.loss_mask)] <= 0) and np.all(lps[~np.asarray(p.loss_mask)] == 0)


@pytest.mark.timeout(180)
def test_uniform_rewards_fill_the_batch_instead_of_stalling(
    tiny_model_dir: Path, tmp_path: Path, server: InferenceServer
) -> None:
    """zero_advantage = "drop" on an environment where every completion scores the same (a mastered
    task): after REFILL_WAVES rounds the batch is filled with those groups (advantage 0, no
    gradient) and the run goes on, instead of failing after MAX_WAVES rounds."""
    from hpcrl.bus import decode
    from hpcrl.orchestrator.loop import REFILL_WAVES

    run = tmp_path / "uniform"
    RunPaths(run).make_dirs()
    announce(server, run)
    extra = (
        "--orchestrator.advantage.zero-advantage",
        "drop",
        "--orchestrator.train.env",
        '[{id = "tests.integration.uniform_env", args = {num_examples = 50}}]',
    )
    orch = start_orchestrator(run, tiny_model_dir, max_steps=1, extra=extra)
    trainer = FakeTrainer(run, tiny_model_dir)
    try:
        trainer.policy(0)
        batch = decode(trainer.batch(1), TrainBatch)
        trainer.policy(1)
        assert orch.wait(timeout=120) == 0, (run / "orchestrator.out").read_text()[-3000:]
    finally:
        if orch.poll() is None:
            orch.kill()
        trainer.close()
    assert (
        batch.num_samples == 8
        and not batch.advantages.any()
        and set(batch.env_names) == {"tests.integration.uniform_env"}
    )
    m = [
        r
        for r in read_metrics(RunPaths(run).metrics_file)
        if r.get("role") == "orchestrator" and r["step"] == 1
    ][0]
    assert m["filter/zero_advantage_filled"] == 2  # 8 samples = 2 groups of 4
    assert m["filter/zero_advantage_dropped"] >= 2 * REFILL_WAVES
    assert "filled the batch with 2 of them" in (run / "orchestrator.out").read_text()


# Last in the module: it leaves the shared server refusing to generate (unverified weights).
@pytest.mark.timeout(120)
def test_checksum_mismatch_is_a_loud_error(
    tiny_model_dir: Path, run_dir: Path, server: InferenceServer
) -> None:
    announce(server, run_dir)
    orch = start_orchestrator(run_dir, tiny_model_dir)
    bus = Bus(RunPaths(run_dir), role="trainer", rank=0)
    try:
        # The weights on disk are the tiny model, but the trainer claims other bytes.
        bus.publish_policy(
            PolicyReady(
                step=0,
                transport="filesystem",
                path=str(tiny_model_dir),
                checksum="xxh3_128:" + "0" * 32,
                num_params=1,
                num_bytes=4,
            )
        )
        assert orch.wait(timeout=90) == 1
    finally:
        if orch.poll() is None:
            orch.kill()
        bus.close()
    out = (run_dir / "orchestrator.out").read_text()
    assert "PolicyMismatch" in out and "checksum" in out
    assert not RunPaths(run_dir).rollout_step_dir(1).exists()
