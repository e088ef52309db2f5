"""Op-level records (``ops=``, probes.core.ops): every torch operation inside the chosen modules, on eager,
ORTModule and torch.compile, named alike everywhere; nothing changes training, and nothing runs elsewhere."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from helpers import OrtWitness, Recorder, assert_moments, gpt2_batch
from probes import StatisticsSubscriber, SubscriberManager, load_dump
from probes.compare import compare_dumps

OLD_DYNAMO = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 6)
D = 8


class Attention(torch.nn.Module):
    """A small attention written the way models write it: linears, an einsum, a mask, a softmax, a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(D, D)
        self.k = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        scores = torch.einsum("bd,cd->bc", q, k) / math.sqrt(D)
        scores = scores.masked_fill(x[:, :4] > 1.0, -1e4)
        weights = torch.softmax(scores, -1)
        return weights @ x + x


def model_and_input(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(D, D), Attention(), torch.nn.Linear(D, 2))
    return model, torch.randn(4, D)


ATTENTION_OPS = ["1/linear:0", "1/linear:1", "1/einsum:0", "1/div:0", "1/getitem:0", "1/masked_fill:0", "1/softmax:0",
                 "1/matmul:0", "1/add:0"]
READS = {"1/getitem:0.output.0"}  # ``x[:, :4]``, made by a call the recorder leaves out: read, a forward record only


def losses_and_grads(model, x, steps=2):
    losses, grads = [], []
    for _ in range(steps):
        model.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
    return losses, grads


def test_each_operation_of_a_selected_module_gets_a_record_named_by_module_op_and_call(tmp_path):
    model, x = model_and_input()
    plain = losses_and_grads(copy.deepcopy(model), x)
    subscriber = StatisticsSubscriber(tmp_path, override_output_dir=True, ops="1")
    with SubscriberManager().subscribe(model, [subscriber]):
        probed = losses_and_grads(model, x)
    for a, b in zip(plain[0] + sum(plain[1], []), probed[0] + sum(probed[1], [])):
        assert torch.equal(a, b)  # bit-identical training
    records = [r for r in load_dump(tmp_path) if r["step"] == 0]
    forward = [r["name"] for r in records if r["phase"] == "forward"]
    assert [name for name in forward if "/" in name] == [f"{op}.output.0" for op in ATTENTION_OPS]
    # Each op record comes before its module's output record; the op records nest under module "1".
    assert forward.index("1/add:0.output.0") < forward.index("1.output.0")
    ops = {r["name"]: r for r in records if r.get("kind") == "op" and r["phase"] == "forward"}
    assert all(r["module"] == "1" and r["module_class"] == "Attention" and r["depth"] == 2 for r in ops.values())
    # Provenance: each tensor argument's record name ("" for parameters and constants).
    assert ops["1/einsum:0.output.0"]["inputs"] == ["1.q.output.0", "1.k.output.0"]
    assert ops["1/softmax:0.output.0"]["inputs"] == ["1/masked_fill:0.output.0"]
    assert ops["1/matmul:0.output.0"]["inputs"] == ["1/softmax:0.output.0", "0.output.0"]
    assert ops["1/linear:0.output.0"]["inputs"] == ["0.output.0", "", ""]
    assert ops["1/getitem:0.output.0"]["inputs"] == ["0.output.0"]
    backward = sorted(r["name"] for r in records if r["phase"] == "backward" and r.get("kind") == "op")
    assert backward == sorted(set(ops) - READS)
    assert not any("/" in r["name"] for r in records if r["module"] != "1")  # only inside the selected module


def test_op_statistics_equal_a_numpy_float64_reference(tmp_path):
    model, x = model_and_input(seed=3)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path, override_output_dir=True, ops="1")]):
        model(x).sum().backward()
    records = {r["name"]: r for r in load_dump(tmp_path) if r["phase"] == "forward"}
    w = {name: p.detach().double().numpy() for name, p in model.named_parameters()}
    h = x.double().numpy() @ w["0.weight"].T + w["0.bias"]
    q, k = h @ w["1.q.weight"].T + w["1.q.bias"], h @ w["1.k.weight"].T + w["1.k.bias"]
    scores = np.where(h[:, :4] > 1.0, -1e4, (q @ k.T) / math.sqrt(D))
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    for name, reference in (("1/einsum:0", q @ k.T), ("1/softmax:0", weights), ("1/add:0", weights @ h + h)):
        record = records[f"{name}.output.0"]
        expected = {"mean": reference.mean(), "std": reference.std(ddof=1), "norm": np.linalg.norm(reference)}
        assert_moments(record, expected, name, rel=1e-5)  # float32 operations against float64
        assert record["max"] == pytest.approx(reference.max(), rel=1e-5, abs=1e-6)


class Views(torch.nn.Module):
    """Views, in-place writes through them, a cast to the same dtype, constants, indexing and ``out=``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * 2.0                       # mul:0
        y.view(-1)[:3] = 0.0                       # an in-place write through a view of a probed output
        z = y.transpose(0, 1).reshape(-1, 4)       # views: no record
        z = z.float().contiguous()                 # same dtype, already contiguous: no record
        z.add_(1.0)                                # in place: no record
        ones = torch.ones(z.shape)                 # a constant: no record
        twos = torch.empty_like(ones)
        torch.mul(ones, 2.0, out=twos)             # out=: no record
        return (z * twos + y.sum()).double()       # mul:1, sum:0, add:0, to float64: double:0


def test_views_in_place_writes_casts_and_constants_keep_training_unchanged():
    torch.manual_seed(1)
    model, x = torch.nn.Sequential(Views()), torch.randn(4, D, requires_grad=True)
    plain = losses_and_grads(copy.deepcopy(model), x)
    recorder = Recorder(ops="0")
    with SubscriberManager().subscribe(model, [recorder]):
        probed = losses_and_grads(model, x)
    for a, b in zip(plain[0] + sum(plain[1], []), probed[0] + sum(probed[1], [])):
        assert torch.equal(a, b)
    ops = [name for name in recorder.names(0, "forward") if "/" in name]
    # The view, the transpose and the constant are read (forward records only); the reshape to the same shape and
    # strides reads the transpose as it is, and unset memory (empty_like) is never read.
    reads = ["0/view:0.output.0", "0/transpose:0.output.0", "0/ones:0.output.0"]
    assert ops == ["0/linear:0.output.0", "0/mul:0.output.0", *reads, "0/mul:1.output.0", "0/sum:0.output.0",
                   "0/add:0.output.0", "0/double:0.output.0"]
    assert sorted(name for name in recorder.names(0, "backward") if "/" in name) == sorted(set(ops) - set(reads))


def test_steps_and_modules_left_out_run_without_the_mode_or_any_op_probe():
    model, x = model_and_input()
    stacks: list[int] = []
    model[2].register_forward_pre_hook(lambda module, args: stacks.append(torch._C._len_torch_function_stack()))
    model[1].q.register_forward_pre_hook(lambda module, args: stacks.append(torch._C._len_torch_function_stack()))
    everything, ops = Recorder(), Recorder(ops="1", steps=[1])
    with SubscriberManager().subscribe(model, [everything, ops]):
        for _ in range(3):
            model(x).sum().backward()
    assert not ops.names(0, "forward") and not ops.names(2, "forward")
    assert [name for name in ops.names(1, "forward") if "/" in name] == [f"{op}.output.0" for op in ATTENTION_OPS]
    assert not any("/" in name for step in range(3) for name in everything.names(step, "forward"))
    # The mode is open only inside module "1" in step 1 (module 1.q's call there), never elsewhere.
    assert stacks == [0, 0, 1, 0, 0, 0]
    assert torch._C._len_torch_function_stack() == 0


def test_a_forward_that_raises_inside_a_selected_module_leaves_no_mode_behind():
    model, x = model_and_input()

    def fail(module, args):
        raise RuntimeError("boom")

    handle = model[1].k.register_forward_pre_hook(fail)
    with SubscriberManager().subscribe(model, [Recorder(ops="1")]):
        with pytest.raises(RuntimeError, match="boom"):
            model(x)
        assert torch._C._len_torch_function_stack() == 0
        handle.remove()
        model(x).sum().backward()  # the next step records as usual
    assert torch._C._len_torch_function_stack() == 0


def test_ops_must_be_patterns():
    with pytest.raises(ValueError, match="ops is empty; pass None"):
        Recorder(ops=[])
    with pytest.raises(ValueError, match="ops"):
        Recorder(ops=3)


@pytest.mark.skipif(OLD_DYNAMO, reason="dynamo traces a TorchFunctionMode from torch 2.6 (the ort lane has 2.4)")
def test_compiled_fullgraph_records_the_same_ops_as_eager(tmp_path):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, x = model_and_input()
    eager_model = copy.deepcopy(model)
    with SubscriberManager().subscribe(eager_model, [StatisticsSubscriber(tmp_path / "eager", ops="1")]):
        eager = losses_and_grads(eager_model, x, steps=3)
    counter = CompileCounterWithBackend("inductor")
    recorder = Recorder(ops="1")
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "compiled", ops="1"), recorder]):
        compiled = losses_and_grads(torch.compile(model, backend=counter, fullgraph=True), x, steps=3)
    assert counter.frame_count == 1  # one graph, no break: the op probes are in it, fired every step
    for step in range(3):
        assert [n for n in recorder.names(step, "forward") if "/" in n] == [f"{op}.output.0" for op in ATTENTION_OPS]
    for a, b in zip(eager[0], compiled[0]):
        assert torch.allclose(a, b, rtol=1e-5)
    report = compare_dumps(tmp_path / "eager", tmp_path / "compiled")
    assert report.agrees and not report.only_in_base and not report.only_in_other, report.first_divergence
    torch._dynamo.reset()


@pytest.mark.skipif(not OLD_DYNAMO, reason="torch >= 2.6 records ops under torch.compile (the test above)")
def test_torch_2_4_compile_warns_that_ops_are_eager_and_ort_only():
    torch._dynamo.reset()
    model, x = model_and_input()
    recorder = Recorder(ops="1")
    with SubscriberManager().subscribe(model, [recorder]):
        with pytest.warns(UserWarning, match=r"op records \(ops=\) under torch.compile need torch >= 2.6"):
            torch.compile(model, backend="aot_eager")(x).sum().backward()
    assert "1.output.0" in recorder.names(0, "forward")  # module records as ever
    torch._dynamo.reset()


@pytest.mark.ort
def test_ortmodule_runs_the_op_probes_in_its_graph_with_the_eager_names(tmp_path, monkeypatch):
    from onnxruntime.training.ortmodule import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model, x = model_and_input()
    eager_model = copy.deepcopy(model)
    with SubscriberManager().subscribe(eager_model, [StatisticsSubscriber(tmp_path / "eager", ops="1")]):
        eager = losses_and_grads(eager_model, x)
    recorder, witness = Recorder(ops="1"), OrtWitness()
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "ort", ops="1"), recorder, witness]):
        ort = losses_and_grads(ORTModule(model), x)
    ops = [c for c in recorder.calls if "/" in c.name]
    assert {c.name for c in ops} == {f"{op}.output.0" for op in ATTENTION_OPS}
    # 2 steps, forward and backward (a read record: forward only)
    assert all(c.by_ort for c in ops) and len(ops) == 2 * (2 * len(ATTENTION_OPS) - len(READS))
    for a, b in zip(eager[0], ort[0]):
        assert torch.allclose(a, b, rtol=1e-5)
    report = compare_dumps(tmp_path / "eager", tmp_path / "ort")
    assert report.agrees and not report.only_in_base and not report.only_in_other, report.first_divergence
    ort_records = [r for r in load_dump(tmp_path / "ort") if r.get("kind") == "op"]
    assert {tuple(r["inputs"]) for r in ort_records if r["name"] == "1/einsum:0.output.0"} == {
        ("1.q.output.0", "1.k.output.0")}


def test_hugging_face_attention_ops_agree_between_two_identical_runs(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
    for run in ("a", "b"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        recorder = Recorder(ops="transformer.h.0.attn")
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / run, ops="transformer.h.0.attn"),
                                                   recorder]):
            model(**gpt2_batch(0)).loss.backward()
    ops = [name for name in recorder.names(0, "forward") if "/" in name]
    # Conv1D's view of its input (read), then its addmm.
    assert ops[:2] == ["transformer.h.0.attn/view:0.output.0", "transformer.h.0.attn/addmm:0.output.0"]
    assert "transformer.h.0.attn/softmax:0.output.0" in ops
    backward = {name for name in recorder.names(0, "backward") if "/" in name}
    assert backward < set(ops) and {f"transformer.h.0.attn/{op}:0.output.0" for op in ("addmm", "softmax")} <= backward
    # The others are read records (forward only): views and constants.
    reads = {name.split("/")[1].split(":")[0] for name in set(ops) - backward}
    assert reads <= {"view", "split", "permute", "transpose", "reshape", "full", "getitem", "unsqueeze", "expand",
                     "contiguous", "flatten", "unflatten", "squeeze", "narrow", "chunk", "arange", "zeros", "ones",
                     "tensor", "full_like", "zeros_like", "ones_like", "new_full", "new_zeros", "new_ones"}, reads
    report = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert report.agrees and len(report.records) == len(load_dump(tmp_path / "a"))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_selected_module_records_its_ops_once_and_trains_unchanged(tmp_path, reentrant):
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.head = Attention(), torch.nn.Linear(D, 2)

        def forward(self, x):  # a non-reentrant recompute stops before the module's forward hook
            return self.head(checkpoint(self.attn, x, use_reentrant=reentrant))

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, D, requires_grad=True)
    plain = copy.deepcopy(model)
    recorder = Recorder(ops="attn")
    with SubscriberManager().subscribe(model, [recorder]):
        probed = losses_and_grads(model, x, steps=3)
    expected = losses_and_grads(plain, x, steps=3)
    for a, b in zip(expected[0] + sum(expected[1], []), probed[0] + sum(probed[1], [])):
        assert torch.equal(a, b)
    names = [op.replace("1/", "attn/") for op in ATTENTION_OPS]
    for step in range(3):  # the head's linear is never taken for an op of the attention
        assert [n for n in recorder.names(step, "forward") if "/" in n] == [f"{op}.output.0" for op in names]
        assert sorted(n for n in recorder.names(step, "backward") if "/" in n) == sorted(
            f"{op}.output.0" for op in names if f"{op.replace('attn/', '1/')}.output.0" not in READS)
    assert torch._C._len_torch_function_stack() == 0
