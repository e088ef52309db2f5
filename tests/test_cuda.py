"""The zoo on a CUDA device: probes change nothing there either (skipped where no CUDA device exists).

Eager and torch.compile (inductor, the backend CUDA users train with) on the device, with and without probes,
and eager+probes against compiled+probes compared clean; the records were computed from CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch

from probes import load_dump
from probes.testing import assert_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

ARCHS = ("llama", "mixtral", "t5")


@pytest.mark.parametrize("arch_name", ARCHS)
def test_zoo_on_cuda_trains_identically_with_probes(arch_name, tmp_path):
    from test_zoo import ARCHITECTURES, _assert_same_training, train

    arch = ARCHITECTURES[arch_name]
    plain = train(arch, "eager", None, device="cuda")
    probed = train(arch, "eager", tmp_path / "eager", device="cuda")
    _assert_same_training(plain, probed, exact=True)
    assert load_dump(tmp_path / "eager"), "no records written from CUDA tensors"
    compiled_plain = train(arch, "compile", None, device="cuda", compile_backend="inductor")
    compiled = train(arch, "compile", tmp_path / "compiled", device="cuda", compile_backend="inductor")
    _assert_same_training(compiled_plain, compiled, exact=False)
    assert compiled.graphs <= compiled_plain.graphs + (1 if compiled_plain.breaks else 0)
    assert_parity(tmp_path / "eager", tmp_path / "compiled")
