"""The embedded engine's MoE routes (router replay): the prefill's routes of every prompt token and the
decode steps' routes of every sampled token but the last, in order, equal the experts an independent
full forward of transformers' model over prompt + completion picks (fp32: no near-ties flip)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe"), preset="tiny-moe", seed=3)


def _full_forward_routes(path: Path, ids: list[int]) -> torch.Tensor:
    """[tokens, layers, k] top-k experts of each position, from one forward without a KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    got = []
    for name, mod in model.named_modules():
        if name.endswith(".mlp.gate"):
            mod.register_forward_hook(lambda _m, _i, out: got.append(out[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return torch.stack(got, dim=1)


@pytest.mark.slow
def test_engine_records_prompt_and_completion_routes_in_order(moe_dir: Path) -> None:
    from hpcrl.inference.engine import HFEngine
    from hpcrl.inference.protocol import SamplingParams

    engine = HFEngine(str(moe_dir), dtype="float32", device="cpu", seed=0)
    try:
        engine.pause()  # two prompts of different lengths in one left-padded prefill
        params = SamplingParams(n=2, max_tokens=6, ignore_eos=True)
        futs = [engine.submit(p, params) for p in ([5, 9, 40, 41, 7], [11, 12, 13])]
        engine.resume()
        outs = [(p, o) for p, f in zip(([5, 9, 40, 41, 7], [11, 12, 13]), futs) for o in f.result(timeout=60)]
    finally:
        engine.shutdown()
    for prompt, o in outs:
        want = _full_forward_routes(moe_dir, prompt + o.token_ids).sort(-1).values
        pr = torch.tensor(o.prompt_routed_experts).sort(-1).values
        comp = torch.tensor(o.routed_experts).sort(-1).values
        assert pr.shape == (len(prompt), 2, 2) and comp.shape == (6, 2, 2)
        assert torch.equal(pr, want[: len(prompt)])
        assert torch.equal(comp[:-1], want[len(prompt) : -1])  # token p's route: computed when p was fed
        assert (comp[-1] == -1).all()  # the last token is never fed back
