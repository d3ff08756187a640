"""Where the MoE mismatch KL comes from: one batch sampled by the embedded engine (bf16, as the
replay runs' inference), then the trainer's logprobs of exactly those tokens, on the same weights,
under each combination of trainer dtype and routing. Deterministic (seeded engine, seeded prompts).

    python scripts/bench/moe.py --part decompose

Rows: trainer fp32 / bf16 x routing free (no replay) / replay of the completion tokens' routes (what
the orchestrator carried before prompt routes existed) / replay of every token's route (prompt from
the engine's prefill, completion from its decode steps). ``KL`` is the runs' mismatch KL (mean over
completion tokens of exp(d) - 1 - d, d = trainer - engine logprob). ``routes differ``: share of
(token, layer) pairs whose top-k set the trainer's own router picks differently from the engine's,
on prompt and on completion tokens. What replay cannot remove is the last row of each dtype: the
engine and the trainer then compute every token with the same experts, so the rest is numerics
(bf16 rounding, transformers' kernels vs hpcrl's). One more row, ``engine impl``: the engine's own
transformers model, in the trainer's dtype, scoring each sample in one full forward (its routers
free): the part of the floor that is decode-with-KV-cache vs full-sequence numerics of ONE
implementation, which no trainer-side change can remove.
"""

from __future__ import annotations

from typing import Any

import torch

ROUTINGS = ("free", "completion", "all")
NAMES = {"free": "off", "completion": "completion", "all": "all tokens", "engine": "engine impl"}


def sample_batch(model_dir: str, prompts: int, n: int, max_tokens: int, device: str) -> list[dict[str, Any]]:
    """``prompts`` x ``n`` completions of random prompts (8-24 tokens) from a bf16 engine, with routes."""
    from hpcrl.inference.engine import HFEngine
    from hpcrl.inference.protocol import SamplingParams

    engine = HFEngine(model_dir, dtype="bfloat16", device=device, seed=0, max_batch_size=prompts * n)
    g = torch.Generator().manual_seed(1)
    try:
        engine.pause()  # admit every request in one prefill, as a rollout batch arrives
        futs = []
        for _ in range(prompts):
            length = int(torch.randint(8, 25, (1,), generator=g))
            prompt = torch.randint(3, engine.vocab_size, (length,), generator=g).tolist()
            params = SamplingParams(n=n, max_tokens=max_tokens, logprobs=True, ignore_eos=True)
            futs.append((prompt, engine.submit(prompt, params)))
        engine.resume()
        out = []
        for prompt, fut in futs:
            for o in fut.result(timeout=600):
                out.append({"prompt": prompt, "out": o})
        return out
    finally:
        engine.shutdown()


def packed(samples: list[dict[str, Any]], routing: str):
    from hpcrl.trainer.packing import PackedBatch

    ids, lps, mask, routes, lens = [], [], [], [], []
    for s in samples:
        p, o = s["prompt"], s["out"]
        comp = torch.tensor(o.routed_experts, dtype=torch.long).flatten(1)
        prompt = torch.tensor(o.prompt_routed_experts, dtype=torch.long).flatten(1)
        if routing == "completion":
            prompt = torch.full_like(prompt, -1)
        ids += p + o.token_ids
        lps += [0.0] * len(p) + o.logprobs
        mask += [False] * len(p) + [True] * len(o.token_ids)
        routes.append(torch.cat([prompt, comp]))
        lens.append(len(p) + len(o.token_ids))
    return PackedBatch(
        input_ids=torch.tensor(ids),
        position_ids=torch.cat([torch.arange(x) for x in lens]),
        seq_lens=torch.tensor(lens),
        loss_mask=torch.tensor(mask),
        inference_logprobs=torch.tensor(lps),
        routed_experts=None if routing == "free" else torch.cat(routes),
    )


def engine_full_forward(
    model_dir: str, samples: list[dict[str, Any]], dtype: str, device: str
) -> torch.Tensor:
    """Completion logprobs (sample order) from the engine's transformers model, one full forward per
    sample, in ``dtype``: what the engine would report without a KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            p, toks = s["prompt"], s["out"].token_ids
            logits = model(input_ids=torch.tensor([p + toks], device=device)).logits[0].float()
            lp = logits[len(p) - 1 : len(p) - 1 + len(toks)].log_softmax(-1)
            out.append(lp.gather(1, torch.tensor(toks, device=device)[:, None])[:, 0].cpu())
    return torch.cat(out)


def _kl_row(dtype: str, routing: str, lp: torch.Tensor, engine_lp: torch.Tensor) -> dict[str, Any]:
    d = lp - engine_lp
    return {"dtype": dtype, "routing": routing, "kl": float((torch.expm1(d) - d).mean()),
            "abs_d": float(d.abs().mean()), "lp": lp}  # fmt: skip


def free_routes(model: torch.nn.Module, mb) -> torch.Tensor:
    """[T, layers, k] experts the trainer's own routers pick (no replay), in token order."""
    from hpcrl.trainer.packing import forward_packed, model_inputs

    got: list[torch.Tensor] = []

    def recording(f):
        def route(x, replay=None):
            idx, w = f(x, replay)
            got.append(idx)
            return idx, w

        return route

    moes = model.moe_layers()
    for m in moes:
        m.route = recording(m.route)  # an instance attribute over the method; deleted below
    try:
        with torch.no_grad():
            forward_packed(model, mb, compute_entropy=False)
    finally:
        for m in moes:
            del m.route
    _, layout = model_inputs(model, mb)  # the grid the forward ran: its slots back to token order
    return torch.stack([g[layout.index] for g in got], dim=1)


def differ(mine: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    """[T] share of layers whose top-k set differs between the trainer's and the engine's routes
    ([T, layers, k]); NaN where the engine has none (a completion's last token, never fed back)."""
    a, b = mine.sort(-1).values, engine.sort(-1).values
    out = (a != b).any(-1).float().mean(-1)
    return out.masked_fill((engine < 0).all(-1).all(-1), float("nan"))


def decompose(
    preset_dir: str,
    prompts: int = 16,
    n: int = 4,
    max_tokens: int = 16,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    device: str = "cpu",
) -> list[dict[str, Any]]:
    from hpcrl.models.spec import load_model
    from hpcrl.trainer.packing import forward_packed

    torch.manual_seed(0)
    samples = sample_batch(preset_dir, prompts, n, max_tokens, device)
    rows = []
    engine_routes = packed(samples, "all").routed_experts.to(device)
    free = packed(samples, "free")
    engine_lp = free.inference_logprobs[free.loss_mask]  # the engine's logprobs of the completions
    for dtype in dtypes:
        model = load_model(preset_dir, dtype, device, attn_impl="sdpa", impl="custom").eval()
        k = model.moe_layers()[0].top_k
        for routing in ROUTINGS:
            mb = packed(samples, routing).to(device)
            with torch.no_grad():
                lp = forward_packed(model, mb, compute_entropy=False).logprobs.float()
            row = _kl_row(dtype, routing, lp[mb.loss_mask].cpu(), mb.inference_logprobs[mb.loss_mask].cpu())
            if routing == "free":
                mine = free_routes(model, mb)
                theirs = engine_routes.view(len(engine_routes), -1, k)
                dif = differ(mine, theirs)
                row["differ_prompt"] = float(dif[~mb.loss_mask].nanmean())
                row["differ_completion"] = float(dif[mb.loss_mask].nanmean())
            rows.append(row)
        rows.append(
            _kl_row(dtype, "engine", engine_full_forward(preset_dir, samples, dtype, device), engine_lp)
        )
    return rows


def bitwise(preset_dir: str, device: str, lens: tuple[int, ...] = (24, 40, 64, 33)) -> dict[str, float]:
    """The custom model against transformers' (the engine's model), bf16, one full forward per random
    sample, transformers' routes replayed into the custom model: KL(transformers || custom) over the
    whole vocabulary, the largest logprob difference and the share of bit-identical logprobs."""
    from transformers import AutoModelForCausalLM

    from hpcrl.models.spec import load_model

    hf = AutoModelForCausalLM.from_pretrained(preset_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    custom = load_model(preset_dir, "bfloat16", device, attn_impl="sdpa", impl="custom").eval()
    routes: list[torch.Tensor] = []
    for name, mod in hf.named_modules():
        if name.endswith(".mlp.gate"):
            mod.register_forward_hook(lambda _m, _i, out: routes.append(out[2]))
    g = torch.Generator().manual_seed(0)
    kls, worst, same = [], 0.0, []
    with torch.no_grad():
        for n in lens:
            ids = torch.randint(3, hf.config.vocab_size, (1, n), generator=g).to(device)
            routes.clear()
            want = hf(input_ids=ids).logits[0].float().log_softmax(-1)
            replay = torch.stack(routes, 1)[None]
            got = custom(input_ids=ids, routed_experts=replay).logits[0].float().log_softmax(-1)
            kls.append(float((want.exp() * (want - got)).sum(-1).mean()))
            worst = max(worst, float((got - want).abs().max()))
            same.append(float((got == want).float().mean()))
    return {"kl": sum(kls) / len(kls), "max_abs": worst, "equal": sum(same) / len(same)}


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """``above floor``: the KL minus the all-tokens row's (every token computed with the engine's
    experts: what is left is numerics), the routing part; ``max |lp - off|``: how far replay moved
    any logprob from the free-routing run."""
    print(f"\n{title}")
    print(
        f"{'trainer':<9} {'replay':<11} {'mismatch KL':>12} {'above floor':>12} {'mean |d|':>9} "
        f"{'max |lp - off|':>15} {'routes differ (prompt / completion)':>36}"
    )
    for r in rows:
        same = [x for x in rows if x["dtype"] == r["dtype"]]
        floor = next(x["kl"] for x in same if x["routing"] == "all")
        free = next(x for x in same if x["routing"] == "free")
        moved = float((r["lp"] - free["lp"]).abs().max())
        dif = f"{r['differ_prompt']:.4f} / {r['differ_completion']:.4f}" if "differ_prompt" in r else ""
        name = NAMES[r["routing"]]
        print(
            f"{r['dtype']:<9} {name:<11} {r['kl']:>12.4g} {r['kl'] - floor:>12.3g} {r['abs_d']:>9.5f} "
            f"{moved:>15.3g} {dif:>36}"
        )
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        kl = {r["routing"]: r["kl"] for r in rows if r["dtype"] == dtype}
        if kl["free"] <= 0:  # the trainer reproduced the engine exactly: no ratio to report
            print(f"{dtype}: mismatch KL 0 without replay (trainer = engine on these tokens)")
            continue
        part = kl["free"] - kl["all"]
        comp = (kl["completion"] - kl["all"]) / part if part > 0 else float("nan")
        print(
            f"{dtype}: replay / off, raw: {kl['all'] / kl['free']:.3f} (all tokens), "
            f"{kl['completion'] / kl['free']:.3f} (completion only); routing part (above the floor) "
            f"{part / kl['free']:.0%} of the off KL, of which replay leaves 0 (all tokens), {comp:.3f} (completion only); "
            f"the engine's own implementation, full forward: {kl['engine'] / kl['free']:.3f} of the off KL"
        )
