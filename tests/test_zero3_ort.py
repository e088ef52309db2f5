"""ZeRO-3 with probes' hooks under ORTModule trains like eager PyTorch with the same hooks.

ORT runs the exported graph, including the ZeRO-3 gather/release PythonOps, on every step: the
model is wrapped in ORTModule before deepspeed.initialize, ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE
(conftest, inherited by the spawned ranks) turns any export failure into an error, and every
ZeRO-3 fetch of a training step is checked to come from ORT's runtime.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from test_zero3 import STEPS, check_dumps, check_zero3_invariants, run_ranks  # noqa: E402
from probes.testing import assert_parity  # noqa: E402

pytestmark = [pytest.mark.ort, pytest.mark.slow]

# Adam's update m / (sqrt(v) + eps) turns gradients that are rounding noise (the key bias of
# attention has an exactly-zero true gradient) into full-size steps of random sign; a larger eps
# keeps that noise from dominating, so that eager and ORT kernels (equal to ~1e-7) stay comparable.
ADAM_EPS = 1e-4
MODULES = 28  # modules of the test transformer, each fetched once per forward


@pytest.mark.parametrize("world_size", [1, 2])
def test_ortmodule_trains_like_eager_with_probes_zero3_hooks(tmp_path, world_size):
    # Both runs also have debug=True: statistics probes next to the ZeRO-3 ones, dumped per rank.
    eager_mode, ort_mode = "probes+stats", "probes+ort+stats"
    for rank, results in enumerate(run_ranks(world_size, tmp_path, [eager_mode, ort_mode], ADAM_EPS)):
        eager, ort = results[eager_mode], results[ort_mode]
        check_zero3_invariants(eager, world_size, f"eager rank {rank}")
        check_zero3_invariants(ort, world_size, f"ort rank {rank}")
        # ORT's runtime made every fetch of the training steps; the rest are its export runs.
        assert not any(eager["fetches_by_ort"])
        assert sum(ort["fetches_by_ort"]) == STEPS * MODULES, len(ort["fetches_by_ort"])
        assert ort["losses"] == pytest.approx(eager["losses"], rel=1e-5), rank
        for step in range(STEPS):
            for name, grad in eager["grads"][step].items():
                torch.testing.assert_close(ort["grads"][step][name], grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        for name, param in eager["params"].items():
            torch.testing.assert_close(ort["params"][name], param, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        # Our hooks are gone (eager keeps 2 of DeepSpeed's engine on the model; with ORT they are on the wrapper).
        assert ort["hooks_after_destroy"] <= eager["hooks_after_destroy"] < eager["hooks_before_destroy"]
    for mode in (eager_mode, ort_mode):
        check_dumps(tmp_path / mode, world_size)
    # Every rank's statistics agree between eager and ORT (records are matched per rank).
    assert_parity(tmp_path / eager_mode, tmp_path / ort_mode, rtol=1e-3, atol=1e-5)
