"""prime-rl's optimizers beyond AdamW: sign SGD and Muon, checked by hand on small cases; their
checkpoints resume to the same next step; the config refuses a field the chosen type does not read.

The sharded (FSDP, 2 gloo ranks) runs of both are in tests/integration/test_optim_fsdp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpcrl.config.sections.trainer import OptimConfig
from hpcrl.errors import ConfigError
from hpcrl.launch.checks import load
from hpcrl.models.spec import load_model
from hpcrl.paths import RunPaths
from hpcrl.trainer import optim
from hpcrl.trainer.muon import Muon
from hpcrl.trainer.sign_sgd import SignSGD
from hpcrl.trainer.state import load_trainer_state, save_trainer_state
from tests.conftest import rl_toml

NS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's quintic Newton-Schulz coefficients (Keller Jordan's)


# ------------------------------------------------------------------------------------------ sign SGD


def test_sign_sgd_two_steps_by_hand() -> None:
    lin = nn.Linear(3, 1)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
        lin.bias.fill_(0.2)
    opt = optim.build_optimizer(lin, "sign_sgd", lr=0.1, weight_decay=0.5)
    assert isinstance(opt, SignSGD)
    # step 1: the weight decays by lr * wd = 5 % (the bias is 1-D: never decayed), then every element
    # moves lr = 0.1 against its gradient's sign, whatever its size; a zero gradient moves nothing.
    #   weight: [1, -2, 0.5] * 0.95 = [0.95, -1.9, 0.475]; grad signs [+, -, 0] -> [0.85, -1.8, 0.475]
    #   bias:   0.2, grad -5 -> 0.2 + 0.1 = 0.3
    lin.weight.grad = torch.tensor([[0.3, -0.01, 0.0]])
    lin.bias.grad = torch.tensor([-5.0])
    opt.step()
    assert lin.weight.detach()[0].tolist() == pytest.approx([0.85, -1.8, 0.475])
    assert lin.bias.item() == pytest.approx(0.3)
    # step 2: [0.85, -1.8, 0.475] * 0.95 = [0.8075, -1.71, 0.45125]; signs [-, -, +]
    #   -> [0.9075, -1.61, 0.35125]; bias grad 0: stays 0.3
    lin.weight.grad = torch.tensor([[-4.0, -4.0, 2.0]])
    lin.bias.grad = torch.tensor([0.0])
    opt.step()
    assert lin.weight.detach()[0].tolist() == pytest.approx([0.9075, -1.61, 0.35125])
    assert lin.bias.item() == pytest.approx(0.3)
    assert len(opt.state) == 0  # stateless


# ---------------------------------------------------------------------------------------------- Muon


class _Toy(nn.Module):
    """The shapes Muon's split must tell apart: embedding, a hidden matrix with a bias, a norm, a stack
    of expert matrices, a router, an LM head, and a frozen matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.experts = nn.Parameter(torch.randn(2, 3, 4))
        self.router = nn.Parameter(torch.randn(2, 4))
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)


def test_muon_param_group_split() -> None:
    toy = _Toy()
    opt = optim.build_optimizer(toy, "muon", lr=0.1, weight_decay=0.01)
    names = {id(p): n for n, p in toy.named_parameters()}
    groups = [
        (g["algorithm"], g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
        for g in opt.param_groups
    ]
    assert groups == [
        ("muon", 0.01, ["experts", "proj.weight", "router"]),  # hidden matrices (and the MoE stacks)
        ("adamw", 0.01, ["embed_tokens.weight", "lm_head.weight"]),  # vocabulary tables: AdamW
        ("adamw", 0.0, ["norm.bias", "norm.weight", "proj.bias"]),  # 1-D: AdamW, not decayed
    ]  # the frozen matrix is in no group
    adamw = opt.param_groups[1]
    assert (adamw["betas"], adamw["eps"], adamw["lr"]) == ((0.9, 0.999), 1e-8, 0.1)  # build_optimizer's
    assert opt.param_groups[0]["momentum"] == 0.95 and opt.param_groups[0]["nesterov"] is False


def test_muon_split_of_the_tiny_qwen3(tiny_model_dir: Path) -> None:
    """The tiny model ties its LM head to the embedding: one table for AdamW, every projection Muon's."""
    model = load_model(tiny_model_dir)
    opt = optim.optimizer_from_config(model, OptimConfig(type="muon", lr=1e-3))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, tables, vectors = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert tables == ["model.embed_tokens.weight"]
    assert all(n.endswith("_proj.weight") for n in muon) and len(muon) == 7 * model.config.num_hidden_layers
    assert all(model.get_parameter(n).ndim == 1 for n in vectors)
    assert opt.param_groups[1]["betas"] == (0.9, 0.95)  # prime-rl's MuonConfig betas for the AdamW part


def _ns5_of_scalar(x: float) -> float:
    """What NS5 does to one singular value: 5 times x <- a x + b x^3 + c x^5."""
    a, b, c = NS
    for _ in range(5):
        x = a * x + b * x**3 + c * x**5
    return x


def test_muon_update_is_the_polar_factor_within_newton_schulz() -> None:
    # G = R(90 deg) diag(3, 1) = [[0, -1], [3, 0]]: its SVD is U = R(90), S = (3, 1), V = I, so the
    # orthogonal polar factor U V^T is R(90) = [[0, -1], [1, 0]]. NS5 keeps U and V and maps each
    # singular value s / ||G||_F (3/sqrt(10) = 0.949, 1/sqrt(10) = 0.316) through the quintic five
    # times: 0.949 -> 0.752 -> 1.048 -> ... ~0.75, and 0.316 -> ... ~1.13 (the coefficients trade
    # exactness for speed: every singular value ends in about [0.7, 1.2], none at exactly 1).
    w = nn.Parameter(torch.zeros(2, 2))
    opt = Muon([{"params": [w], "algorithm": "muon"}], lr=0.1, mu=0.95)
    w.grad = torch.tensor([[0.0, -1.0], [3.0, 0.0]])
    opt.step()
    s_big, s_small = _ns5_of_scalar(3 / 10**0.5), _ns5_of_scalar(1 / 10**0.5)
    assert 0.7 < s_big < 0.8 and 1.1 < s_small < 1.2
    # the first step's momentum is (1 - mu) G, a multiple of G (NS5 normalises it away); the step is
    # -lr * 0.2 * sqrt(max(2, 2)) * O = -0.028284 * U diag(s_big, s_small) V^T
    step = 0.1 * 0.2 * 2**0.5
    want = -step * torch.tensor([[0.0, -s_small], [s_big, 0.0]])
    torch.testing.assert_close(w.detach(), want, atol=step * 2**-7, rtol=0)  # bf16: 8 bits of mantissa
    # The same on a random 6 x 4 matrix against its SVD: same singular vectors (U^T O V diagonal),
    # singular values within Newton-Schulz's band, and O within 0.35 of U V^T everywhere.
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, s, vt = torch.linalg.svd(g, full_matrices=False)
    m = nn.Parameter(torch.zeros(6, 4))
    opt = Muon([{"params": [m], "algorithm": "muon"}], lr=1.0, mu=0.0)
    m.grad = g.float()
    opt.step()
    ortho = -m.detach().double() / (0.2 * 6**0.5)  # undo lr * 0.2 * sqrt(max(6, 4))
    inner = u.T @ ortho @ vt.T
    assert (inner - torch.diag(torch.diagonal(inner))).abs().max() < 0.03
    assert torch.diagonal(inner).min() > 0.6 and torch.diagonal(inner).max() < 1.25
    assert (ortho - u @ vt).abs().max() < 0.35


def test_muon_is_torch_muon_on_matrices_and_torch_adamw_on_the_rest() -> None:
    """Unsharded, the update is bit for bit torch.optim.Muon's (nesterov off, match_rms_adamw: what
    prime-rl's dion Muon does) on the matrices and torch.optim.AdamW's on the rest."""
    gen = torch.Generator().manual_seed(1)
    w0, v0 = torch.randn(5, 3, generator=gen), torch.randn(5, generator=gen)
    w, v = nn.Parameter(w0.clone()), nn.Parameter(v0.clone())
    w2, v2 = nn.Parameter(w0.clone()), nn.Parameter(v0.clone())
    ours = Muon(
        [{"params": [w], "algorithm": "muon"}, {"params": [v], "algorithm": "adamw"}],
        lr=0.05, weight_decay=0.1, mu=0.9, betas=(0.9, 0.95),
    )  # fmt: skip
    muon = torch.optim.Muon(
        [w2], lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW([v2], lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))
    for _ in range(3):
        gw, gv = torch.randn(5, 3, generator=gen), torch.randn(5, generator=gen)
        w.grad, w2.grad, v.grad, v2.grad = gw, gw.clone(), gv, gv.clone()
        ours.step(), muon.step(), adamw.step()
    assert torch.equal(w, w2) and torch.equal(v, v2)
    assert set(ours.state[w]) == {"momentum_buffer"} and set(ours.state[v]) == {
        "step",
        "exp_avg",
        "exp_avg_sq",
    }


def test_muon_refuses_vectors_and_unknown_algorithms() -> None:
    with pytest.raises(ValueError, match="not shape \\[3\\]"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "algorithm": "muon"}], lr=0.1)
    with pytest.raises(ValueError, match="'lion'"):
        Muon([{"params": [nn.Parameter(torch.zeros(3, 3))], "algorithm": "lion"}], lr=0.1)


# ------------------------------------------------------------------------------------ checkpoints


def _step(model: nn.Module, opt: torch.optim.Optimizer, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


@pytest.mark.parametrize("kind", ["muon", "sign_sgd", "sgd"])
def test_resume_gives_the_same_next_step(kind: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two steps, a checkpoint, a third step; a fresh model and optimizer restored from the checkpoint
    take the same third step, bit for bit."""
    paths = RunPaths(tmp_path / "run")
    paths.make_dirs()
    cfg = OptimConfig(type=kind, lr=1e-2, weight_decay=0.01, warmup_steps=2)  # type: ignore[arg-type]

    def build() -> tuple[nn.Module, torch.optim.Optimizer, object]:
        model = load_model(tiny_model_dir)
        opt = optim.optimizer_from_config(model, cfg)
        return model, opt, optim.build_scheduler(opt, "cosine", warmup_steps=2, total_steps=6)

    model, opt, sched = build()
    for s in (1, 2):
        _step(model, opt, sched, s)
    save_trainer_state(paths, 2, 0, 1, model, opt, sched, {"step": 2})
    _step(model, opt, sched, 3)
    model2, opt2, sched2 = build()
    assert load_trainer_state(paths, 2, 0, 1, model2, opt2, sched2) == {"step": 2}
    _step(model2, opt2, sched2, 3)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    if kind != "sign_sgd":
        assert len(opt2.state) > 0
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.state[p2][k])), k


# ------------------------------------------------------------------------------------------ config


def _cfg(tmp_path: Path, *flags: str):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(rl_toml(2))
    return load([str(cfg), "--output-dir", str(tmp_path / "o"), *flags], require_envs=False).config


def test_config_defaults_per_type(tmp_path: Path) -> None:
    muon = _cfg(tmp_path, "--trainer.optim.type", "muon").trainer.optim
    assert muon.settings() == {"betas1": 0.9, "betas2": 0.95, "eps": 1e-8, "mu": 0.95}
    adamw = _cfg(tmp_path, "--trainer.optim.betas2", "0.98").trainer.optim
    assert adamw.settings() == {"betas1": 0.9, "betas2": 0.98, "eps": 1e-8}
    sgd = _cfg(tmp_path, "--trainer.optim.type", "sgd").trainer.optim
    assert sgd.settings() == {"momentum": 0.9, "nesterov": True}  # prime-rl's SGDConfig
    assert OptimConfig(type="sgd", momentum=0.0).settings() == {"momentum": 0.0, "nesterov": False}
    assert _cfg(tmp_path, "--trainer.optim.type", "sign_sgd").trainer.optim.settings() == {}
    assert OptimConfig(betas=[0.8, 0.9]).settings() == {"betas1": 0.8, "betas2": 0.9, "eps": 1e-8}


@pytest.mark.parametrize(
    ("flags", "path", "message"),
    [
        (["--trainer.optim.mu", "0.9"], "trainer.optim.mu", "applies to type = 'muon' only, not 'adamw'"),
        (
            ["--trainer.optim.type", "sign_sgd", "--trainer.optim.betas1", "0.8"],
            "trainer.optim.betas1",
            "applies to type = 'adamw' or 'muon' only, not 'sign_sgd'",
        ),
        (
            ["--trainer.optim.type", "muon", "--trainer.optim.momentum", "0.5"],
            "trainer.optim.momentum",
            "applies to type = 'sgd' only, not 'muon'",
        ),
        (
            ["--trainer.optim.type", "sgd", "--trainer.optim.betas", "[0.9, 0.9]"],
            "trainer.optim.betas",
            "'sgd'",
        ),
        (
            ["--trainer.optim.betas", "[0.9, 0.99]", "--trainer.optim.betas2", "0.95"],
            "trainer.optim.betas2",
            "0.95 conflicts with betas[1] = 0.99",
        ),
        (
            [
                "--trainer.optim.type",
                "sgd",
                "--trainer.optim.momentum",
                "0",
                "--trainer.optim.nesterov",
                "true",
            ],
            "trainer.optim.nesterov",
            "needs momentum > 0",
        ),
        (["--trainer.optim.type", "lion"], "trainer.optim.type", "allowed: adamw, muon, sgd, sign_sgd"),
        (["--trainer.optim.mu", "1.5"], "trainer.optim.mu", "< 1.0"),
    ],
)
def test_config_refuses_what_the_type_does_not_read(
    tmp_path: Path, flags: list[str], path: str, message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, *flags)
    assert e.value.path == path and message in e.value.message, str(e.value)
