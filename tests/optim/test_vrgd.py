"""VR optimizers: gamma = 1 reproduces the base optimizers; gamma < 1 matches hand math."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dlrm_vrgd.optim.vrgd import VRLAMB, VRLARS, VRSGD, VRAdagrad, VRAdam

SHAPES = [(6, 4), (4,), (3, 6), (3,)]


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def group_grads(step: int, k: int, scale: float = 1.0) -> list[list[torch.Tensor]]:
    """``k`` groups of gradients with a shared signal and per-group noise."""
    g = torch.Generator().manual_seed(1000 + step)
    signal = [torch.randn(*s, generator=g) for s in SHAPES]
    return [
        [scale * (sig + torch.randn(*sig.shape, generator=g) * 2.0) for sig in signal]
        for _ in range(k)
    ]


def vr_steps(opt, params, steps: int, k: int = 4, start: int = 0) -> None:
    for step in range(start, start + steps):
        for grads in group_grads(step, k):
            for p, gr in zip(params, grads, strict=True):
                p.grad = gr.clone()
            opt.collect()
        opt.step()


def base_steps(opt, params, steps: int, k: int = 4) -> None:
    for step in range(steps):
        groups = group_grads(step, k)
        for i, p in enumerate(params):
            p.grad = torch.stack([g[i] for g in groups]).mean(0)
        opt.step()


# ------------------------------------------------------------- references from the papers
class LARS(torch.optim.Optimizer):
    """You, Gitman & Ginsburg 2017, Algorithm 1 (with the trust ratio skipped for 1-D params)."""

    def __init__(self, params, lr, momentum, weight_decay, eta, eps):
        super().__init__(params, dict(lr=lr, momentum=momentum, wd=weight_decay, eta=eta, eps=eps))

    @torch.no_grad()
    def step(self):
        for gr in self.param_groups:
            for w in gr["params"]:
                g = w.grad
                local = 1.0
                if w.ndim > 1 and w.norm() > 0 and g.norm() > 0:
                    local = gr["eta"] * w.norm() / (g.norm() + gr["wd"] * w.norm() + gr["eps"])
                v = self.state[w].setdefault("v", torch.zeros_like(w))
                v.copy_(gr["momentum"] * v + gr["lr"] * local * (g + gr["wd"] * w))
                w.sub_(v)


class LAMB(torch.optim.Optimizer):
    """You et al. 2019, Algorithm 2 with phi = identity."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, wd=weight_decay))

    @torch.no_grad()
    def step(self):
        for gr in self.param_groups:
            b1, b2 = gr["betas"]
            for w in gr["params"]:
                st = self.state[w]
                if not st:
                    st.update(t=0, m=torch.zeros_like(w), v=torch.zeros_like(w))
                st["t"] += 1
                t, g = st["t"], w.grad
                st["m"] = b1 * st["m"] + (1 - b1) * g
                st["v"] = b2 * st["v"] + (1 - b2) * g * g
                r = (st["m"] / (1 - b1**t)) / ((st["v"] / (1 - b2**t)).sqrt() + gr["eps"])
                u = r + gr["wd"] * w
                ratio = w.norm() / u.norm() if w.norm() > 0 and u.norm() > 0 else 1.0
                w.sub_(gr["lr"] * ratio * u)


CASES = {
    "sgd": (
        lambda ps: VRSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, gamma=1.0),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "sgd_dampening": (
        lambda ps: VRSGD(ps, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.0, gamma=1.0),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3),
    ),
    "adamw": (
        lambda ps: VRAdam(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, gamma=1.0),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
    ),
    "lars": (
        lambda ps: VRLARS(
            ps, lr=2.0, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, gamma=1.0
        ),
        lambda ps: LARS(ps, lr=2.0, momentum=0.9, weight_decay=1e-3, eta=0.02, eps=1e-8),
    ),
    "adagrad": (
        lambda ps: VRAdagrad(
            ps, lr=0.05, eps=1e-8, weight_decay=0.01, initial_accumulator_value=0.1, gamma=1.0
        ),
        lambda ps: torch.optim.Adagrad(
            ps, lr=0.05, eps=1e-8, weight_decay=0.01, initial_accumulator_value=0.1
        ),
    ),
    "lamb": (
        lambda ps: VRLAMB(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, gamma=1.0),
        lambda ps: LAMB(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("foreach", [True, False])
def test_gamma_one_reproduces_base_optimizer(case: str, foreach: bool) -> None:
    make_vr, make_base = CASES[case]
    ours, ref = make_params(), make_params()
    opt = make_vr(ours)
    opt.foreach = foreach
    vr_steps(opt, ours, steps=6)
    base_steps(make_base(ref), ref, steps=6)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(ours[0], make_params()[0])


def test_vrsgd_step_hand_computed() -> None:
    """θ' = θ − lr · clip(r / mean r, γ, 1) ⊙ ḡ, computed in float64 numpy."""
    params = make_params()
    theta0 = [p.detach().double().numpy().copy() for p in params]
    groups = group_grads(0, k=5)
    opt = VRSGD(params, lr=0.3, gamma=0.1)
    for grads in groups:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.collect()
    opt.step()
    for i, p in enumerate(params):
        g = np.stack([grads[i].double().numpy() for grads in groups])
        mean, var = g.mean(0), g.var(0)  # population variance = s - mean^2
        r = mean**2 / var
        r = np.clip(r / r.mean(), 0.1, 1.0)
        np.testing.assert_allclose(
            p.detach().numpy(), theta0[i] - 0.3 * r * mean, rtol=1e-5, atol=1e-6
        )
    summary = opt.gsnr_summary()
    assert [s["numel"] for s in summary] == [24, 4, 18, 3]
    assert all(0.1 <= s["ratio"] <= 1 and 0 <= s["frac_clipped"] <= 1 for s in summary)


def test_gamma_below_one_damps_noisy_elements() -> None:
    """Within a tensor, high-GSNR elements take the full SGD step, noisy ones γ of it."""
    w = torch.nn.Parameter(torch.zeros(200))
    opt = VRSGD([w], lr=1.0, gamma=0.1)
    clean = [1.01, 0.99, 1.01, 0.99]  # mean 1, variance 1e-4: raw GSNR 1e4
    noisy = [1.2, -1.0, 1.0, -1.0]  # mean 0.05, variance ~1: raw GSNR ~0.0025
    groups = [
        torch.cat([torch.full((100,), c), torch.full((100,), n)])
        for c, n in zip(clean, noisy, strict=True)
    ]
    for gr in groups:
        w.grad = gr.clone()
        opt.collect()
    opt.step()
    # mean raw GSNR ~ 5e3: clean elements normalize to ~2 -> 1, noisy ones to ~0 -> γ
    torch.testing.assert_close(w.detach()[:100], torch.full((100,), -1.0))
    torch.testing.assert_close(w.detach()[100:], torch.full((100,), -0.1 * 0.05))
    (summary,) = opt.gsnr_summary()
    assert summary["frac_clipped"] == pytest.approx(0.5)
    assert summary["ratio"] == pytest.approx(0.55, rel=1e-5)  # a float32 mean


def test_loss_scale_does_not_change_the_ratios() -> None:
    results = []
    for scale in (1.0, 1000.0):
        params = make_params()
        opt = VRSGD(params, lr=0.1, gamma=0.1)
        for grads in group_grads(0, k=6, scale=scale):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.collect()
        opt.step()
        results.append([s["ratio"] for s in opt.gsnr_summary()])
    assert results[0] == pytest.approx(results[1], rel=1e-5)


@pytest.mark.parametrize("foreach", [True, False])
def test_vradagrad_ratio_one_step_is_torch_adagrad(foreach: bool) -> None:
    """With γ < 1 but one group a step the ratio is 1 and VR-Adagrad's own step kernel runs
    (not torch's, which γ = 1 hands it to): it must still be ``torch.optim.Adagrad``."""
    ours, ref = make_params(), make_params()
    opt = VRAdagrad(ours, lr=0.05, weight_decay=0.01, initial_accumulator_value=0.1, gamma=0.2)
    opt.foreach = foreach
    vr_steps(opt, ours, steps=4, k=1)
    base = torch.optim.Adagrad(ref, lr=0.05, weight_decay=0.01, initial_accumulator_value=0.1)
    base_steps(base, ref, steps=4, k=1)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
    assert opt.state[ours[0]].keys() == base.state[ref[0]].keys() == {"step", "sum"}
    torch.testing.assert_close(opt.state[ours[0]]["sum"], base.state[ref[0]]["sum"])


@pytest.mark.parametrize("cls", [VRSGD, VRAdam, VRLARS, VRLAMB, VRAdagrad])
def test_state_dict_round_trip_mid_run(cls) -> None:
    kwargs = {"lr": 0.01, "gamma": 0.2}
    if cls is VRSGD:
        kwargs["momentum"] = 0.9
    a_params = make_params()
    a = cls(a_params, **kwargs)
    vr_steps(a, a_params, steps=6)

    b_params = make_params()
    b = cls(b_params, **kwargs)
    vr_steps(b, b_params, steps=3)
    state = copy.deepcopy(b.state_dict())
    c_params = [torch.nn.Parameter(p.detach().clone()) for p in b_params]
    c = cls(c_params, **kwargs)
    c.load_state_dict(state)
    vr_steps(c, c_params, steps=3, start=3)
    for x, y in zip(a_params, c_params, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_per_group_hyperparameters() -> None:
    p1, p2 = make_params()[:2]
    opt = VRSGD([{"params": [p1], "gamma": 1.0, "lr": 0.0}, {"params": [p2], "gamma": 0.5}], lr=0.1)
    before1 = p1.detach().clone()
    for grads in group_grads(0, k=3):
        p1.grad, p2.grad = grads[0].clone(), grads[1].clone()
        opt.collect()
    opt.step()
    assert torch.equal(p1, before1)  # lr 0 in its group
    s = opt.gsnr_summary()
    assert s[0]["frac_clipped"] == 0.0 and min(s[1]["ratio"], 1.0) >= 0.5


def test_named_parameters_name_the_summary() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = VRAdam(model.named_parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.collect()
    opt.step()
    assert [s["name"] for s in opt.gsnr_summary()] == ["0.weight", "0.bias"]


def test_closure_is_collected_as_a_group() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    opt = VRSGD([w], lr=0.5, gamma=1.0)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 2.0
    torch.testing.assert_close(w.detach(), torch.tensor([0.0, 0.0]))  # w - 0.5 * 2w


def test_single_group_is_plain_sgd_with_a_warning(caplog) -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = VRSGD([w], lr=0.1, gamma=0.1)
    w.grad = torch.tensor([1.0, -3.0])
    opt.collect()
    with caplog.at_level("WARNING"):
        opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([0.9, 2.3]))
    assert "GSNR is undefined" in caplog.text


def test_step_without_collect_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="collect"):
        VRSGD(make_params(), lr=0.1).step()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: VRSGD(p, lr=-0.1), "learning rate"),
        (lambda p: VRSGD(p, lr=0.1, gamma=0.0), "gamma"),
        (lambda p: VRSGD(p, lr=0.1, gamma=1.5), "gamma"),
        (lambda p: VRAdam(p, betas=(1.0, 0.9)), "beta parameter at index 0"),
        (lambda p: VRAdam(p, betas=(0.9, -0.1)), "beta parameter at index 1"),
        (lambda p: VRLAMB(p, gsnr_beta=1.0), "gsnr_beta"),
        (lambda p: VRLARS(p, trust_coefficient=0.0), "trust_coefficient"),
        (lambda p: VRSGD(p, lr=0.1, nesterov=True), "Nesterov"),
        (lambda p: VRAdam(p, weight_decay=-1.0), "weight_decay"),
        (lambda p: VRAdagrad(p, initial_accumulator_value=-0.1), "initial_accumulator_value"),
        (lambda p: VRAdagrad(p, eps=-1e-10), "epsilon"),
        (lambda p: VRAdagrad(p, placement="moments"), "placement"),
        (lambda p: VRAdagrad(p, gamma=0.0), "gamma"),
    ],
)
def test_bad_hyperparameters_are_named(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(make_params())


def test_no_nan_with_zero_gradients() -> None:
    params = make_params()
    opt = VRLAMB(params, lr=0.1)
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.collect()
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def _cross_rank_worker(rank: int, world: int, cls_name: str, a: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    from dlrm_vrgd.optim import vrgd

    params = make_params()
    opt = getattr(vrgd, cls_name)(params, lr=0.05, gamma=0.2, process_group=dist.group.WORLD)
    for step in range(3):
        groups = group_grads(step, k=world * a)
        for grads in groups[rank * a : (rank + 1) * a]:  # this rank's micro-batches
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.collect()
        opt.step()
    return [p.detach() for p in params]


# one optimizer in CI (the collectives are the same for all three); all three in make test-slow
@pytest.mark.parametrize(
    "cls",
    [
        pytest.param(VRSGD, marks=pytest.mark.slow),
        VRAdam,
        pytest.param(VRLAMB, marks=pytest.mark.slow),
        pytest.param(VRAdagrad, marks=pytest.mark.slow),
    ],
)
def test_two_ranks_equal_one_rank_with_twice_the_groups(cls, tmp_path) -> None:
    from ..dist_utils import run_ranks

    ranks = run_ranks(_cross_rank_worker, 2, tmp_path, cls.__name__, 3)
    single_params = make_params()
    single = cls(single_params, lr=0.05, gamma=0.2)
    vr_steps(single, single_params, steps=3, k=6)
    for rank_params in ranks:
        for a, b in zip(rank_params, single_params, strict=True):
            torch.testing.assert_close(a, b.detach())


def test_gsnr_variance_is_the_mean_over_groups_hand_computed() -> None:
    """DESIGN.md 4.1 with k = 4 groups of one 3-element tensor, by hand:
    σ² = (1/k)Σ g_d² − ḡ² (the 1/k mean, no k/(k − 1) correction), r = ḡ²/σ².

    * element 0, groups 1, 2, 3, 6: ḡ = 3, s = 50/4 = 12.5, σ² = 3.5, r = 9/3.5 = 18/7;
    * element 1, groups 0, 0, 0, 4: ḡ = 1, s = 4, σ² = 3, r = 1/3 (= 1/(k − 1));
    * element 2, groups 2, 2, 2, 2: σ² = 0, degenerate (r = 1, out of the mean).

    Mean raw GSNR 61/42 (with the k/(k − 1) factor it would be 3/4 of that, 61/56); ratios
    normalized by it, clipped to [0.1, 1]: 1, (1/3)/(61/42) = 14/61, 1; VR-SGD moves each
    element by lr·r·ḡ. A constant factor on σ² cancels in the normalized ratio, so only the
    raw GSNR the telemetry reports can tell the two variances apart: it is pinned here."""
    w = torch.nn.Parameter(torch.zeros(3))
    opt = VRSGD([w], lr=0.5, gamma=0.1)
    for g in ([1.0, 0.0, 2.0], [2.0, 0.0, 2.0], [3.0, 0.0, 2.0], [6.0, 4.0, 2.0]):
        w.grad = torch.tensor(g)
        opt.collect()
    opt.step()
    (entry,) = opt.gsnr_summary()
    assert entry["raw_gsnr"] == pytest.approx(61 / 42, rel=1e-6)
    assert entry["raw_gsnr"] != pytest.approx(61 / 56, rel=1e-2)  # Bessel's k/(k − 1)
    assert entry["frac_degenerate"] == pytest.approx(1 / 3)
    ratio = torch.tensor([1.0, 14 / 61, 1.0])
    assert entry["ratio"] == pytest.approx(float(ratio.mean()), rel=1e-6)
    torch.testing.assert_close(w.detach(), -0.5 * ratio * torch.tensor([3.0, 1.0, 2.0]))
