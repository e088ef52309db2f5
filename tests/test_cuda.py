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


def test_a_records_hash_is_the_same_on_cuda_as_on_the_cpu():
    from probes.stats.hashing import tensor_hash
    from probes.stats.one_tensor import tensor_record

    torch.manual_seed(0)
    base = torch.randn(33, 17)
    for tensor in (base, base.t(), base.half(), base.bfloat16(), base.double(), (base * 100).int(), base > 0,
                   base[1:, ::2], torch.zeros(0), torch.randn(5, dtype=torch.complex64)):
        on_cpu = tensor_record(tensor, hash=True)["hash"]
        on_cuda = tensor_record(tensor.cuda(), hash=True)
        assert on_cuda["hash"] == on_cpu, tensor.dtype
        assert tensor_record(tensor.cuda(), hash=True, run_on_cpu=True)["hash"] == on_cpu
        if not tensor.is_complex():
            assert int(tensor_hash(tensor.cuda())) == on_cpu
