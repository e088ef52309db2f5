"""ORTModule's session threads and spinning, which ORTModule itself offers no setting for
(``exporters.ortmodule_threads``; docs/zero3.md "Threads per rank")."""

from __future__ import annotations

import pytest
import torch

ortmodule = pytest.importorskip("onnxruntime.training.ortmodule")

import exporters  # noqa: E402


def _session_options(threads: int | None):
    """The options of the training session an ORTModule builds on its first step."""
    handle = None if threads is None else exporters.ortmodule_threads(threads)
    try:
        torch.manual_seed(0)
        model = ortmodule.ORTModule(torch.nn.Linear(4, 3))
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    manager = model._torch_module._execution_manager(True)
    return manager._execution_agent._inference_session.get_session_options()


def test_sessions_built_under_the_handle_get_the_budget_and_later_ones_ort_defaults():
    chosen = _session_options(1)
    assert chosen.intra_op_num_threads == 1
    assert chosen.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    default = _session_options(None)  # after remove(): ORTModule's own options again
    assert default.intra_op_num_threads == 0
    with pytest.raises(RuntimeError, match="does not have configuration"):  # no entry: ORT spins (its default)
        default.get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize("threads", [0, -1, 1.5])
def test_bad_thread_count_is_refused(threads):
    with pytest.raises(ValueError, match="intra_op_threads must be an int >= 1"):
        exporters.ortmodule_threads(threads)
