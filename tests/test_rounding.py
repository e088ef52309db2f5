"""perturbed_rounding: a calibration run perturbs the training computation's rounding, only inside its block.

Checked against numpy float64 and against runs made without it: which operations move and by how much (about
an ulp of their dtype), that exact operations, the optimizer's update, no_grad work and float64 stay exact, that
it is seeded and leaves the global RNG alone, that nothing of it outlives its block (exit, exception, another
thread), and that a probed calibration run trains exactly as an unprobed one with the same seed.
"""

from __future__ import annotations

import copy
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.testing import perturbed_rounding


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _train(model: nn.Module, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """|a - b| in units of a's float32 spacing (numpy float64)."""
    a64, b64 = a.detach().double().numpy(), b.detach().double().numpy()
    return np.abs(a64 - b64) / np.spacing(np.abs(a.detach().numpy()).astype(np.float32)).astype(np.float64)


def test_a_computed_result_moves_by_about_an_ulp_and_exact_operations_not_at_all():
    torch.manual_seed(0)
    a, b = torch.randn(64, 32, requires_grad=True), torch.randn(32, 48)
    plain = a @ b
    with perturbed_rounding(seed=3) as noise:
        moved = a @ b
        copies = (a.clone(), torch.cat([a, a]), a.max(), torch.relu(a), a.t().contiguous(), a[3:5], a.detach())
    steps = _ulps(plain, moved)
    assert noise.perturbed >= 1 and steps.max() <= 2.0  # (1 + u * eps) * y rounded: at most two ulps
    assert (steps > 0).mean() > 0.3, "most results should move"
    assert steps.mean() < 1.0
    for original, inside in zip((a.clone(), torch.cat([a, a]), a.max(), torch.relu(a), a.t().contiguous(), a[3:5],
                                 a.detach()), copies):
        assert torch.equal(original, inside)


def test_bfloat16_moves_by_bfloat16_ulps():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    w = torch.randn(64, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = x @ w
        with perturbed_rounding(seed=1):
            moved = x @ w
    plain, moved = plain.detach(), moved.detach()
    assert plain.dtype is moved.dtype is torch.bfloat16
    spacing = np.spacing(np.abs(plain.float().numpy())) * 2 ** 16  # float32 spacing x 2^16: bfloat16's
    steps = np.abs(moved.double().numpy() - plain.double().numpy()) / spacing
    assert steps.max() <= 2.0 and (steps > 0).any()


def test_seeded_bit_identical_and_another_seed_another_run():
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        model = _model()
        with perturbed_rounding(seed=seed):
            runs[name] = _train(model)
    plain = _train(_model())
    assert runs["a"][0] == runs["b"][0] and all(torch.equal(runs["a"][1][k], runs["b"][1][k]) for k in runs["a"][1])
    assert runs["a"][0] != runs["c"][0]
    assert runs["a"][0] != plain[0]
    np.testing.assert_allclose(runs["a"][0], plain[0], rtol=1e-5)  # rounding, not another computation


def test_the_backward_is_perturbed_but_not_the_update_no_grad_work_or_float64():
    model = _model()
    x = torch.randn(8, 16)
    loss = model(x).pow(2).mean()  # forward outside
    reference = copy.deepcopy(model)
    reference(x).pow(2).mean().backward()
    with perturbed_rounding(seed=1) as noise:
        loss.backward()  # only the backward inside
    grads = [p.grad for p in model.parameters()]
    assert noise.perturbed > 0 and any(not torch.equal(g, r.grad) for g, r in zip(grads, reference.parameters()))

    # The optimizer's update (in place, under no_grad), evaluation under no_grad and float64: exact.
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="perturbed no operation"), perturbed_rounding(seed=1) as noise:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        with torch.no_grad():
            evaluated = model(x)
        wide = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
        product = wide @ wide
    for p, w, g in zip(model.parameters(), weights, grads):
        assert torch.equal(p.detach(), w.add(g, alpha=-0.1))  # SGD's update, as it computes it
    with torch.no_grad():
        assert torch.equal(evaluated, model(x))
    assert torch.equal(product, wide @ wide)
    assert noise.perturbed == 0


def test_the_global_rng_is_untouched():
    def work() -> torch.Tensor:
        torch.manual_seed(5)
        torch.randn(8, 8, requires_grad=True).exp().sum().backward()
        return torch.rand(4)  # what dropout or a data loader would draw next

    expected = work()
    with perturbed_rounding(seed=1) as noise:
        got = work()
    assert noise.perturbed > 0 and torch.equal(got, expected)


def test_nothing_outlives_the_block():
    model = _model()
    before = _train(copy.deepcopy(model))
    with pytest.raises(RuntimeError, match="inside"):
        with perturbed_rounding(seed=1):
            model(torch.randn(2, 16))
            raise RuntimeError("an error inside the block")
    noise = perturbed_rounding(seed=1)
    with pytest.warns(RuntimeWarning, match="perturbed no operation"):
        noise.remove()
    noise.remove()  # idempotent
    assert not noise.active
    after = _train(copy.deepcopy(model))
    assert before[0] == after[0] and all(torch.equal(before[1][k], after[1][k]) for k in before[1])

    # Another thread is not perturbed while the block is active here.
    found = {}
    with pytest.warns(RuntimeWarning, match="perturbed no operation"), perturbed_rounding(seed=1):
        thread = threading.Thread(target=lambda: found.setdefault("run", _train(copy.deepcopy(model))))
        thread.start()
        thread.join()
    assert found["run"][0] == before[0]


def test_the_handle_is_removed_on_its_own_thread_and_in_order():
    noise = perturbed_rounding(seed=1)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raises(noise.remove)))
    thread.start()
    thread.join()
    assert errors == ["RuntimeError: a dispatch mode must be removed on the thread that entered it"]
    inner = perturbed_rounding(seed=2)
    with pytest.raises(RuntimeError, match="entered after this one"):
        noise.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nothing was perturbed
        inner.remove()
        noise.remove()
    assert not noise.active and not inner.active


def _raises(call) -> str | None:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def test_a_block_that_perturbs_nothing_warns():
    with pytest.warns(RuntimeWarning, match="perturbed no operation: the calibration run must run its training eagerly"):
        with perturbed_rounding(seed=1):
            torch.randn(4, 4, dtype=torch.float64).exp()


@pytest.mark.parametrize("bad", [{"seed": 1.5}, {"seed": True}, {"ulps": 0}, {"ulps": -1.0}, {"ulps": "one"}])
def test_bad_arguments(bad):
    with pytest.raises((TypeError, ValueError), match="perturbed_rounding: (seed|ulps)"):
        perturbed_rounding(**bad)


def test_a_probed_calibration_run_trains_as_an_unprobed_one_and_its_records_are_what_the_model_produced(tmp_path):
    unprobed = _model()
    with perturbed_rounding(seed=1):
        expected = _train(unprobed)

    model = _model()
    outputs: dict[int, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        outputs[len(outputs)] = output.detach().clone()

    model[2].register_forward_hook(keep)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "noise", override_output_dir=True)]):
        with perturbed_rounding(seed=1):
            got = _train(model)
    assert got[0] == expected[0]  # the probes draw nothing and change nothing, also in a calibration run
    assert all(torch.equal(got[1][name], expected[1][name]) for name in expected[1])
    records = {(r["step"], r["name"]): r for r in load_dump(tmp_path / "noise") if r["phase"] == "forward"}
    for step, output in outputs.items():
        record = records[(step, "2.output.0")]
        values = output.double().numpy()
        assert record["mean"] == pytest.approx(values.mean(), rel=1e-12, abs=1e-15)
        assert record["norm"] == pytest.approx(np.sqrt((values ** 2).sum()), rel=1e-12)
        assert (record["min"], record["max"]) == (values.min(), values.max())
