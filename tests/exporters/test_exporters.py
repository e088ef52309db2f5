"""exporters/: probes as com.microsoft::PythonOp (standalone and under ORTModule), ZeRO-3 embeddings.

Over 400 lines: the standalone and the ORTModule exports share one set of models and graph helpers below.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import textwrap

import onnx
import pytest
import torch

import exporters
from exporters.adapters import torch_internals as compat
from exporters.pythonop import PythonOpExportError
from helpers import Recorder, Square, called_by_ort_runtime, called_from
from exporters.adapters import ort_internals as _ort
from probes import SubscriberManager
from probes.core.functions import TensorProbe
from probes.models import TinyTransformer, TransformerConfig, make_batch

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
CLONE_WARNING = "A clone will be done"


# Helpers ------------------------------------------------------------------------------------------


def python_ops(model_proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model_proto.graph.node if n.domain == "com.microsoft" and n.op_type == "PythonOp"]


def attr(node: onnx.NodeProto, name: str):
    value = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)
    return value.decode() if isinstance(value, bytes) else value


def output_shapes(model_proto: onnx.ModelProto, op_type: str) -> list[list]:
    """Shapes of the first output of every ``op_type`` node, after ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model_proto)
    infos = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output]}
    shapes = []
    for node in inferred.graph.node:
        if node.op_type == op_type:
            dims = infos[node.output[0]].type.tensor_type.shape.dim
            shapes.append([d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims])
    return shapes


def probed_transformer():
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    recorder, manager = Recorder(), SubscriberManager()
    manager.subscribe(model, [recorder])
    return model, manager, recorder


def eager_site_names(tokens: torch.Tensor) -> list[str]:
    """The probe sites one eager forward of a TinyTransformer reports (``embed.output`` ...)."""
    model, recorder = TinyTransformer(CONFIG), Recorder()
    with SubscriberManager().subscribe(model, [recorder]):
        model(tokens)
    return [call.name.rsplit(".", 1)[0] for call in recorder.calls if call.phase == "forward"]


def called_by_inference_session() -> bool:
    return called_from("onnxruntime/capi/onnxruntime_inference_collection.py")


class SessionRecorder(Recorder):
    """A Recorder that also notes whether an ORT InferenceSession run made each forward call."""

    def __init__(self):
        super().__init__()
        self.by_session: list[bool] = []

    def on_event(self, event):
        super().on_event(event)
        if event.kind == "forward":
            self.by_session.append(called_by_inference_session())




class Scale(torch.autograd.Function):
    """An unrelated custom Function with its own symbolic: torch exports it as a Mul."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None

    @staticmethod
    def symbolic(g, x, factor):
        return g.op("Mul", x, g.op("Constant", value_t=torch.tensor(factor, dtype=torch.float32)))


class TaggedProbe(torch.autograd.Function):
    """A probe Function registered by a test: an identity with an int tag."""

    @staticmethod
    def forward(ctx, tag, x):
        return (x.view_as(x),)

    @staticmethod
    def backward(ctx, grad):
        return None, grad


class WithCustomFunctions(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return self.function.apply(y) if self.function is Square else self.function.apply(y, 2.0)


class CallsProbe(torch.nn.Module):
    def __init__(self, first_arg):
        super().__init__()
        self.first_arg = first_arg
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        (y,) = self.first_arg(x)
        return self.linear(y)


def partitioned(embedding: torch.nn.Embedding) -> torch.nn.Embedding:
    """What ZeRO-3 leaves of an embedding between gathers: an empty (0,) weight with its full shape."""
    full_shape = tuple(embedding.weight.shape)
    embedding.weight.data = torch.empty(0)
    embedding.weight.ds_shape = full_shape
    return embedding


class GatheringEmbedding(torch.nn.Embedding):
    """Gathers its partitioned weight around the lookup, like ZeRO-3's forward hooks."""

    def forward(self, indices):
        saved = self.weight.data
        self.weight.data = torch.randn(self.weight.ds_shape)
        try:
            return super().forward(indices)
        finally:
            self.weight.data = saved


class EmbeddingModel(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        self.embed = embedding
        self.head = torch.nn.Linear(embedding.embedding_dim, 3)

    def forward(self, indices):
        return self.head(self.embed(indices))


INDICES = torch.tensor([[1, 2, 3], [4, 5, 6]])


class SizesBeside(torch.nn.Module):
    """Returns sizes beside its tensors, as Swin's embeddings do (ints in eager, 0-dim tensors in a trace), and
    two integer tensors it computes on purpose."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):  # (batch, height, width, 4)
        hidden = self.linear(x)
        height, width = x.shape[1:3]
        return hidden, (height, width), (height + 1) // 2, hidden.argmax(-1), torch.arange(width)


class WithSizes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = SizesBeside()

    def forward(self, x):
        hidden, (height, width), half, index, positions = self.block(x)
        return hidden.sum() * half + index.sum() + positions.sum() + width


PIXELS = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0))


# Standalone export (both lanes) --------------------------------------------------------------------


def test_one_python_op_per_probe_with_func_name_and_site():
    model, manager, recorder = probed_transformer()
    tokens = make_batch(CONFIG, batch_size=2)["tokens"]
    sites = eager_site_names(tokens)

    proto = exporters.export_onnx(model, (tokens,))

    onnx.checker.check_model(proto)
    nodes = python_ops(proto)
    assert len(nodes) == len(sites) + 1  # one TensorProbe per probed site, one StepBoundary
    probes_ = [n for n in nodes if attr(n, "func_name") == "probes.core.functions.TensorProbe"]
    boundaries = [n for n in nodes if attr(n, "func_name") == "probes.core.functions.StepBoundary"]
    assert len(boundaries) == 1 and attr(boundaries[0], "comment") == "step_boundary"
    assert sorted(attr(n, "comment") for n in probes_) == sorted(sites)
    for node in nodes:
        assert attr(node, "input_convention") == "cd"
        assert attr(node, "input_pointer_scalar_positions") == [0]
        assert attr(node, "training_mode") == 1
        assert attr(node, "input_tensor_types") == attr(node, "output_tensor_types") == [onnx.TensorProto.FLOAT]
        assert len(node.output) == 2 and node.output[0].endswith("_ctx")  # ORT's context output first
        assert attr(node, "tensor_reuse_map") == [-1, 0] and attr(node, "bw_tensor_reuse_map") == [1]
    # Export runs are not steps and report nothing.
    assert manager.step == 0 and recorder.calls == []
    exporters.export_onnx(model, (tokens,), training=False)
    assert manager.step == 0 and recorder.calls == []
    manager.unsubscribe()


def test_export_writes_the_file_and_restores_the_pythonop_symbolic(tmp_path):
    model, manager, _ = probed_transformer()
    before = compat.active_symbolic("prim::PythonOp", 17)
    path = tmp_path / "model.onnx"
    exporters.export_onnx(model, (make_batch(CONFIG, batch_size=2)["tokens"],), path, training=False)
    assert compat.active_symbolic("prim::PythonOp", 17) is before
    loaded = onnx.load(path)
    onnx.checker.check_model(loaded)
    assert [attr(n, "training_mode") for n in python_ops(loaded)] == [0] * len(python_ops(loaded))
    manager.unsubscribe()


def test_unrelated_function_with_its_own_symbolic_exports_next_to_probes():
    model = WithCustomFunctions(Scale)
    manager = SubscriberManager()
    manager.subscribe(model, [Recorder()])
    proto = exporters.export_onnx(model, (torch.randn(2, 4),))
    assert len(python_ops(proto)) == 3  # linear, root, step boundary
    assert "Mul" in [n.op_type for n in proto.graph.node]
    manager.unsubscribe()


def test_function_without_any_exporter_is_named_in_the_error(monkeypatch):
    # As on a machine without ORT: no prim::PythonOp symbolic was registered before ours.
    monkeypatch.setattr(exporters.symbolic.compat, "active_symbolic", lambda name, opset: None)
    with pytest.raises(PythonOpExportError, match=r"helpers\.Square"):
        exporters.export_onnx(WithCustomFunctions(Square), (torch.randn(2, 4),))


def test_tensor_hidden_in_a_non_tensor_argument_names_the_probe_and_argument():
    # A probe that cannot be exported is left out of the graph with a warning: the export never fails for it.
    model = CallsProbe(lambda x: TensorProbe.apply([x], x))
    with pytest.warns(exporters.ProbeExportWarning, match=r"probes\.core\.functions\.TensorProbe: argument 0 \(list\) holds a torch\.Tensor.*leaves this probe out"):
        proto = exporters.export_onnx(model, (torch.randn(2, 4),))
    assert python_ops(proto) == []


@pytest.fixture
def tagged_probe():
    exporters.register_probe_function(TaggedProbe, describe=lambda args: f"tag={args[0]}")
    yield TaggedProbe
    exporters.registry.unregister_probe_function(TaggedProbe)


def test_registered_probe_exports_its_scalars_and_rejects_an_unpassable_one(tagged_probe):
    proto = exporters.export_onnx(CallsProbe(lambda x: tagged_probe.apply(7, x)), (torch.randn(2, 4),))
    (node,) = python_ops(proto)
    assert attr(node, "func_name") == "test_exporters.TaggedProbe"
    assert attr(node, "comment") == "tag=7"
    assert attr(node, "input_int_scalars") == [7] and attr(node, "input_int_scalar_positions") == [0]
    assert attr(node, "input_pointer_scalars") is None  # an int is a frozen constant, not a pointer

    with pytest.warns(exporters.ProbeExportWarning, match=r"TaggedProbe: argument 0 \(int\) holds the int \d+, which does not fit"):
        proto = exporters.export_onnx(CallsProbe(lambda x: tagged_probe.apply(2**70, x)), (torch.randn(2, 4),))
    assert python_ops(proto) == []


def test_register_probe_function_checks_its_argument():
    with pytest.raises(TypeError, match="autograd.Function"):
        exporters.register_probe_function(torch.nn.Linear)

    class Local(torch.autograd.Function):
        pass

    with pytest.raises(ValueError, match="module level"):
        exporters.register_probe_function(Local)


def test_install_for_ort_costs_nothing_without_onnxruntime():
    if importlib.util.find_spec("onnxruntime") is not None:
        exporters.install_for_ort()
        assert exporters.ort.is_installed() == _ort.is_ortmodule_imported()
        return
    finders = list(sys.meta_path)
    exporters.install_for_ort()
    assert sys.meta_path == finders and "onnxruntime" not in sys.modules


def test_alias_maps_follow_the_calling_convention():
    single = onnx.helper.make_node("PythonOp", ["x"], ["ctx", "x1"], domain="com.microsoft", input_convention="ccd")
    assert exporters.pythonop.identity_alias_input(single.SerializeToString()) == ([2], [-1, -1, 0])
    assert exporters.pythonop.reuse_map_attributes("ccd") == {"tensor_reuse_map": [-1, 0], "bw_tensor_reuse_map": [1]}
    # Several tensors: in an inference graph no alias declared; in a training graph the forward's only
    # (see identity_alias_maps).
    assert exporters.pythonop.identity_alias_maps("cdcd") == ([-1, -1], [-1, -1, -1, -1])
    assert exporters.pythonop.reuse_map_attributes("cdd") == {"tensor_reuse_map": [-1, -1, -1],
                                                               "bw_tensor_reuse_map": [-1, -1]}
    assert exporters.pythonop.identity_alias_maps("cdcd", training=True) == ([1, 3], [-1, -1, -1, -1])
    assert exporters.pythonop.reuse_map_attributes("cdd", training=True) == {"tensor_reuse_map": [-1, 0, 1],
                                                                              "bw_tensor_reuse_map": [-1, -1]}
    pair = onnx.helper.make_node("PythonOp", ["x", "y"], ["ctx", "x1", "y1"], domain="com.microsoft",
                                 input_convention="cdd", training_mode=1)
    assert exporters.pythonop.identity_alias_input(pair.SerializeToString()) == ([1, 2], [-1, -1, -1])
    pair.attribute[-1].i = 0
    assert exporters.pythonop.identity_alias_input(pair.SerializeToString()) == ([-1, -1], [-1, -1, -1])
    shapes, types = exporters.pythonop.identity_infer_shape(single, [[2, "n"], None], [1, 7])
    assert shapes == [[2, "n"], None] and types == [1, 7]


# ZeRO-3 partitioned embeddings (both lanes) ------------------------------------------------------


def test_partitioned_embedding_exports_with_the_full_output_shape():
    model = EmbeddingModel(partitioned(torch.nn.Embedding(10, 4)))
    original_forward = torch.nn.Embedding.forward
    with pytest.raises(Exception, match="'weight' must be 2-D"):
        exporters.export_onnx(model, (INDICES,))

    with exporters.partitioned_embedding_export():
        proto = exporters.export_onnx(model, (INDICES,))
        with pytest.raises(RuntimeError, match="'weight' must be 2-D"):
            model(INDICES)  # a training step (not an export run) is left alone

    assert output_shapes(proto, "ATen") == [[2, 3, 4]]
    assert torch.nn.Embedding.forward is original_forward
    with pytest.raises(Exception, match="'weight' must be 2-D"):
        exporters.export_onnx(model, (INDICES,))  # removed on exit


def test_traced_embedding_on_a_partitioned_weight_gets_its_rank_from_the_indices():
    model = EmbeddingModel(partitioned(GatheringEmbedding(10, 4)))
    plain = exporters.export_onnx(model, (INDICES,))
    # Typed from the (0,) weight: torch's Gather gives rank 2 (ORT's ATen, if registered, rank 1), not 3.
    (wrong,) = output_shapes(plain, "Gather") + output_shapes(plain, "ATen")
    assert len(wrong) != 3

    with exporters.partitioned_embedding_export(model):
        fixed = exporters.export_onnx(model, (INDICES,))
    assert output_shapes(fixed, "ATen") == [[2, 3, 4]]

    with exporters.partitioned_embedding_export():  # without the model the dim is unknown, the rank right
        (shape,) = output_shapes(exporters.export_onnx(model, (INDICES,)), "ATen")
    assert shape[:2] == [2, 3] and len(shape) == 3


def test_ordinary_embedding_export_is_unchanged_by_the_partitioned_exporter():
    torch.manual_seed(0)
    model = EmbeddingModel(torch.nn.Embedding(10, 4))
    before = exporters.export_onnx(model, (INDICES,)).SerializeToString()
    symbolic_before = compat.active_symbolic("aten::embedding", 17)
    with exporters.partitioned_embedding_export(model):
        inside = exporters.export_onnx(model, (INDICES,)).SerializeToString()
    after = exporters.export_onnx(model, (INDICES,)).SerializeToString()
    assert before == inside == after
    assert compat.active_symbolic("aten::embedding", 17) is symbolic_before


def test_the_tracer_stands_in_for_sizes_with_tensors_told_apart_from_computed_ones():
    seen = {}

    class Numbers(torch.nn.Module):
        def forward(self, x):
            height, width = x.shape[1], x.size(2)
            candidates = {"height": height, "arithmetic": (height + 1) // 2 * width, "arange": torch.arange(width),
                          "sum": x.sum(), "count": (x > 0).sum(), "literal": torch.tensor(3), "mixed": x.sum() * height}
            seen.update({name: compat.is_traced_number(value) for name, value in candidates.items()})
            return x * width

    assert compat.is_traced_number(torch.tensor(3)) is False  # outside a trace
    torch.jit.trace(Numbers(), (PIXELS,), check_trace=False)
    assert seen == {"height": True, "arithmetic": True, "arange": False, "sum": False, "count": False,
                    "literal": False, "mixed": False}


def test_export_leaves_traced_sizes_out_of_the_probes_and_keeps_computed_int_tensors():
    torch.manual_seed(0)
    model, recorder, manager = WithSizes(), Recorder(), SubscriberManager()
    manager.subscribe(model, [recorder])
    model(PIXELS)
    eager = recorder.records(0, "forward")
    assert {"block.output.0", "block.output.1", "block.output.2"} <= set(eager) and "block.output.3" not in eager
    proto = exporters.export_onnx(model, (PIXELS,), training=True, input_names=["x"])
    node = next(n for n in python_ops(proto) if attr(n, "comment") == "block.output")
    int64, float32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    assert attr(node, "input_tensor_types") == [float32, int64, int64]  # hidden, argmax, arange: no size
    if _ort.is_onnxruntime_installed():  # the exported graph runs, and its probes see what eager's saw
        (loss,) = exporters.inference_session(proto).run(None, {"x": PIXELS.numpy()})
        with torch.no_grad():
            assert torch.allclose(torch.from_numpy(loss), model(PIXELS))
        assert recorder.records(1, "forward") == eager
    manager.unsubscribe()


# ORT (onnxruntime-training 1.19.2, torch 2.4.1) ---------------------------------------------------


def ortmodule(model, **debug):
    from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule

    if debug:
        return ORTModule(model, DebugOptions(log_level=LogLevel.WARNING, **debug))
    return ORTModule(model)


@pytest.mark.ort
@pytest.mark.slow
def test_exported_graph_runs_in_ort_which_calls_the_probes(capfd):
    torch.manual_seed(0)
    reference = TinyTransformer(CONFIG).eval()
    model = copy.deepcopy(reference)
    recorder, manager = SessionRecorder(), SubscriberManager()
    manager.subscribe(model, [recorder])
    proto = exporters.export_onnx(model, (make_batch(CONFIG, batch_size=2)["tokens"],), training=False,
                                  input_names=["tokens"])
    session = exporters.inference_session(proto)
    for step in range(2):
        tokens = make_batch(CONFIG, batch_size=2, seed=step)["tokens"]
        (logits,) = session.run(None, {"tokens": tokens.numpy()})
        with torch.no_grad():
            assert torch.allclose(torch.from_numpy(logits), reference(tokens), atol=1e-5)
    assert recorder.calls and all(recorder.by_session), "a probe call did not come from the ORT session"
    probes_per_step = len(python_ops(proto)) - 1  # the step boundary reports nothing
    assert [c.step for c in recorder.calls] == [0] * probes_per_step + [1] * probes_per_step
    assert manager.step == 2  # the graph's StepBoundary ended each run's forward
    assert CLONE_WARNING not in capfd.readouterr().out
    manager.unsubscribe()


@pytest.mark.ort
@pytest.mark.slow
def test_unrelated_function_goes_to_orts_exporter_and_runs():
    _ort.enable_pythonop_runners()  # registers ORT's prim::PythonOp exporter and runners
    torch.manual_seed(0)
    model = WithCustomFunctions(Square)
    manager = SubscriberManager()
    manager.subscribe(model, [Recorder()])
    x = torch.randn(2, 4)
    proto = exporters.export_onnx(model, (x,), training=False, input_names=["x"])
    func_names = sorted(attr(n, "func_name") for n in python_ops(proto))
    assert func_names == ["helpers.Square", "probes.core.functions.StepBoundary", "probes.core.functions.TensorProbe",
                          "probes.core.functions.TensorProbe"]
    (result,) = exporters.inference_session(proto).run(None, {"x": x.numpy()})
    manager.unsubscribe()
    with torch.no_grad():
        assert torch.allclose(torch.from_numpy(result), model(x), atol=1e-6)


@pytest.mark.ort
@pytest.mark.slow
def test_ortmodule_trains_with_the_probes_our_exporter_emitted(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    model, manager, recorder = probed_transformer()
    tokens = make_batch(CONFIG, batch_size=2)["tokens"]
    sites = eager_site_names(tokens)
    wrapped = ortmodule(model, save_onnx=True, onnx_prefix="probed")
    for step in range(3):
        batch = make_batch(CONFIG, batch_size=2, seed=step)
        wrapped(batch["tokens"], labels=batch["labels"]).backward()

    assert manager.step == 3
    assert recorder.calls and all(call.by_ort for call in recorder.calls), "a probe call did not come from ORT"
    for step in range(3):
        assert sorted(recorder.names(step, "forward")) == sorted(recorder.names(step, "backward"))
        assert len(recorder.names(step, "forward")) == len(sites)
    exported = onnx.load(tmp_path / "probed_torch_exported_training.onnx")
    comments = [attr(n, "comment") for n in python_ops(exported) if attr(n, "func_name").endswith("TensorProbe")]
    assert sorted(comments) == sorted(sites), "ORTModule did not export the probes with exporters/"
    assert CLONE_WARNING not in capfd.readouterr().out
    manager.unsubscribe()


class DataPointers(Recorder):
    def __init__(self):
        super().__init__()
        self.pointers: dict[tuple[int, str, str], tuple[int, ...]] = {}

    def on_event(self, event):
        if event.kind in ("forward", "backward"):
            self.pointers[(event.step, event.kind, event.site.name)] = tuple(t.data_ptr() for t in event.tensors)
        else:
            super().on_event(event)


class TwoOutputs(torch.nn.Module):
    def forward(self, x):
        return x * 2, x * 3


class SharedGradients(torch.nn.Module):
    """A two-tensor probe whose two gradients ORT passes in one buffer (an Add's backward)."""

    def __init__(self):
        super().__init__()
        self.linear, self.two = torch.nn.Linear(4, 4), TwoOutputs()

    def forward(self, x):
        a, b = self.two(self.linear(x))
        return a + b


@pytest.mark.ort
@pytest.mark.slow
def test_ort_passes_probe_outputs_in_their_inputs_buffers(capfd):
    # Linear -> Identity: the Identity's probe gets the Linear probe's output. ORT copies a PythonOp
    # output unless alias_input declares it to be the input, so equal buffers prove the registration.
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Identity())
    recorder, manager = DataPointers(), SubscriberManager()
    manager.subscribe(inner, [recorder])
    model = ortmodule(inner)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    manager.unsubscribe()
    step = 1  # ORT's first run copies every input once, to learn what the Function saves
    for phase in ("forward", "backward"):
        linear, identity, root = (recorder.pointers[(step, phase, site)] for site in ("0", "1", "<root>"))
        assert linear == identity == root, phase
    assert CLONE_WARNING not in capfd.readouterr().out


class PairConsumed(torch.nn.Module):
    """A two-tensor probe whose outputs are the inputs of two Identity probes."""

    def __init__(self):
        super().__init__()
        self.linear, self.two = torch.nn.Linear(4, 4), TwoOutputs()
        self.first, self.second = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, x):
        a, b = self.two(self.linear(x))
        return self.first(a) * self.second(b)


@pytest.mark.ort
@pytest.mark.slow
def test_ort_passes_both_outputs_of_a_two_tensor_probe_in_their_inputs_buffers(capfd):
    # A training graph declares every forward alias of a probe of several tensors (ORT's first run checks
    # it on its own copies of the inputs); the gradients of such a probe are still copied by ORT.
    torch.manual_seed(0)
    unprobed = PairConsumed()
    inner = copy.deepcopy(unprobed)
    recorder, manager = DataPointers(), SubscriberManager()
    manager.subscribe(inner, [recorder])
    model, plain = ortmodule(inner), ortmodule(unprobed)
    x = torch.randn(2, 4)
    for _ in range(2):
        for runner in (model, plain):
            runner(x).sum().backward()
    manager.unsubscribe()
    assert torch.equal(model(x), plain(x))  # probes change nothing ORT computes, gradients included
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(inner.parameters(), unprobed.parameters()))
    step = 1
    assert recorder.pointers[(step, "forward", "two")] == (recorder.pointers[(step, "forward", "first")][0],
                                                          recorder.pointers[(step, "forward", "second")][0])
    out = capfd.readouterr().out
    assert "TensorProbe -> Forward ONNX Op attribute" not in out and "Fatal" not in out
    assert "TensorProbe -> Backward ONNX Op attribute" in out  # the test can see ORT's copy where it is made


@pytest.mark.ort
@pytest.mark.slow
def test_ortmodule_threads_sets_the_sessions_built_inside():
    from onnxruntime.training.ortmodule import ORTModule

    def session_options(ort_model):
        agent = ort_model._torch_module._execution_manager(True)._execution_agent
        return agent._inference_session.get_session_options()

    with pytest.raises(ValueError, match="intra_op_threads must be an int >= 1"):
        exporters.ortmodule_threads(0)
    x = torch.randn(2, 4)
    with exporters.ortmodule_threads(1):
        inside = ORTModule(torch.nn.Linear(4, 4))
        inside(x).sum().backward()
    outside = ORTModule(torch.nn.Linear(4, 4))
    outside(x).sum().backward()
    options = session_options(inside)
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert session_options(outside).intra_op_num_threads == 0  # ORT's default: one per core


@pytest.mark.ort
@pytest.mark.slow
def test_probe_of_two_tensors_sharing_a_gradient_buffer_trains_in_ort():
    torch.manual_seed(0)
    eager_model = SharedGradients()
    inner = copy.deepcopy(eager_model)
    manager, recorder = SubscriberManager(), Recorder()
    manager.subscribe(inner, [recorder])
    model = ortmodule(inner)
    x = torch.randn(2, 4)
    for _ in range(2):
        loss = model(x).sum()
        loss.backward()  # a declared alias would fail here: ORT's check cannot tell the two gradients apart
    assert loss.item() == pytest.approx(eager_model(x).sum().item(), rel=1e-5)
    assert {c.name for c in recorder.calls if c.phase == "backward" and c.step == 1} >= {"two.output.0"}
    manager.unsubscribe()


@pytest.mark.ort
@pytest.mark.slow
def test_ortmodule_exports_a_partitioned_embedding(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    with pytest.raises(Exception, match="'weight' must be 2-D") as failure:
        ortmodule(EmbeddingModel(partitioned(torch.nn.Embedding(10, 4))))(INDICES)
    assert "ATen node" not in str(failure.value)  # failed in ORT's eager output-schema run

    model = ortmodule(EmbeddingModel(partitioned(torch.nn.Embedding(10, 4))), save_onnx=True, onnx_prefix="zero3")
    with exporters.partitioned_embedding_export():
        # The export now succeeds; running the graph on the empty weight then fails in the ATen node
        # (under real ZeRO-3, ORT's own stage-3 support feeds it the gathered weight).
        with pytest.raises(Exception, match="ATen node"):
            model(INDICES)
    exported = onnx.load(tmp_path / "zero3_torch_exported_training.onnx")
    (shape,) = output_shapes(exported, "ATen")
    assert len(shape) == 3 and shape[-1] == 4


@pytest.mark.ort
def test_orts_own_embedding_symbolic_is_corrected():
    ortmodule(torch.nn.Linear(2, 2))  # constructing an ORTModule registers ORT's symbolics (opset 17)
    model = EmbeddingModel(partitioned(GatheringEmbedding(10, 4)))
    (wrong,) = output_shapes(exporters.export_onnx(model, (INDICES,)), "ATen")
    assert len(wrong) != 3  # ORT 1.19.2 types the output from the (0,) weight
    with exporters.partitioned_embedding_export(model):
        assert output_shapes(exporters.export_onnx(model, (INDICES,)), "ATen") == [[2, 3, 4]]


@pytest.mark.ort
@pytest.mark.slow
def test_install_waits_for_the_ortmodule_import():
    script = textwrap.dedent(
        """
        import sys
        import exporters
        from probes import StatisticsSubscriber  # defining the probe Functions registers them with exporters/
        exporters.install_for_ort()
        assert "onnxruntime.training.ortmodule" not in sys.modules
        assert not exporters.ort.is_installed()
        import onnxruntime.training.ortmodule
        assert exporters.ort.is_installed()
        from onnxruntime.training.ortmodule._custom_autograd_function_exporter import _SpecialCustomFunctionHandler
        assert _SpecialCustomFunctionHandler.get_handler("probes.core.functions.TensorProbe") is not None
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


@pytest.mark.ort
@pytest.mark.slow
def test_ortmodule_records_what_eager_records_of_a_module_returning_sizes():
    records = {}
    for backend in ("eager", "ort"):
        torch.manual_seed(0)
        model, recorder, manager = WithSizes(), Recorder(), SubscriberManager()
        manager.subscribe(model, [recorder])
        runner = ortmodule(model) if backend == "ort" else model
        for step in range(2):
            runner(PIXELS + step).backward()
        manager.unsubscribe()
        records[backend] = [recorder.records(step, phase) for step in range(2) for phase in ("forward", "backward")]
        if backend == "ort":
            assert recorder.calls and all(call.by_ort for call in recorder.calls), "a probe call did not come from ORT"
    assert records["ort"] == records["eager"]
    assert {"block.output.1", "block.output.2"} <= set(records["ort"][0])  # argmax and arange: int tensors
