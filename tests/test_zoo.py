"""The model zoo on every backend of the lane: probes never change or stop the training of a real architecture.

For each (architecture, backend) of ``zoo.ARCHITECTURES`` x {eager, ORTModule (ort lane), torch.compile}:
- training with probes runs, and its losses and gradients equal those without probes on the same backend;
- eager+probes against backend+probes compares clean (``assert_parity``) at the default tolerances;
- under torch.compile, probes add no graph and no graph break (one fresh dynamo cache per run: recompiles
  across the steps count as graphs too);
- ORTModule runs with fallback disabled and the test proves ORT's runtime called the probes.
A combination is skipped only when the backend fails on the model without probes, with that error. A model that
draws random numbers in its forward (``Architecture.draws``) draws other numbers under ORTModule than in eager (ORT's
own generator): there training with and without probes must be equal bit for bit, and eager against ORT is not
compared.

And the coverage test: for each (architecture, backend), every module that returns a floating-point tensor in a plain
eager run (forward hooks, its outputs flattened with torch's pytree) has a forward record of each such tensor in the
probed run's first step (``<module>.output.<k>``, ``#<call>`` after the name from a module's second call in a step),
and a backward record of each that a gradient reaches after the module returned it (an identity Function on each in
that eager run; views of one another get a forward record only, on every backend); a missing record fails the test
with its name.

With ``PROBES_ZOO_MATRIX=<file>`` each outcome is appended as a JSON line; ``tests/support_matrix.py``
renders those lines as docs/support.md.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch._dynamo

from helpers import OrtWitness, counting_backend
from exporters.adapters.torch_internals import pytree
from probes import StatisticsSubscriber, SubscriberManager, load_table
from probes.testing import assert_parity
from zoo import ARCHITECTURES, Architecture

pytest.importorskip("transformers")

LANE = os.environ.get("PROBES_LANE", "unknown")
STEPS = 3
# The attention each lane trains with: ORT 1.19 exports only eager attention for every architecture
# (scaled_dot_product_attention fails to export for some); the modern lane uses transformers' default.
ATTENTION = "eager" if LANE == "ort" else "sdpa"
COMPILE_BACKEND = "aot_eager"  # dynamo + AOT autograd + the partitioner: what probes meet; inductor: slow test
# Every attention module's operations are recorded too (op records, ``ops=``): the class of modules whose code
# differs most between architectures and backends (masks, casts, einsums, ``is_compiling()`` branches).
OPS = "re:.*Attention"


@dataclass
class Run:
    losses: list[float]
    grads: dict[str, torch.Tensor]
    graphs: int = 0
    breaks: int = 0
    by_ort: int = 0
    seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)
    tied: frozenset[str] = frozenset()  # parameters used under several names (tied embeddings)


def train(arch: Architecture, backend: str, out: Path | None, *, compile_backend: str = COMPILE_BACKEND,
          device: str = "cpu", hooked: bool = False) -> Run:
    """``STEPS`` SGD steps of ``arch`` on ``backend`` (eager | ort | compile); statistics to ``out`` if given;
    ``hooked``: with a forward hook that does nothing on every module."""
    model = arch.build(seed=0, attention=ATTENTION).to(device)
    if hooked:
        for module in list(model.modules())[1:]:
            module.register_forward_hook(lambda module, args, outputs: outputs)
    manager = None
    witness = OrtWitness() if backend == "ort" else None
    if out is not None:
        manager = SubscriberManager()
        manager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True, ops=OPS)]
                          + ([witness] if witness else []))
    names: dict[int, list[str]] = collections.defaultdict(list)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)].append(name)
    run = Run([], {}, tied=frozenset(group[0] for group in names.values() if len(group) > 1))
    runner = model
    if backend == "ort":
        from onnxruntime.training.ortmodule import ORTModule

        runner = ORTModule(model)
    elif backend == "compile":
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        runner = torch.compile(model, backend=counting_backend(run, compile_backend))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    started = time.perf_counter()
    try:
        for step in range(STEPS):
            optimizer.zero_grad()
            with arch.autocast(device):
                loss = arch.loss(runner, arch.batch(step, device))
            loss.backward()
            run.losses.append(loss.item())
            if step == STEPS - 1:
                run.grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            optimizer.step()
    finally:
        if manager is not None:
            manager.unsubscribe()
    run.seconds = time.perf_counter() - started
    if backend == "compile":
        breaks = torch._dynamo.utils.counters["graph_break"]
        run.breaks = sum(breaks.values())
        run.reasons = sorted(breaks)
        torch._dynamo.reset()
    if witness is not None:
        run.by_ort = witness.by_ort
    return run


def _record(arch: str, backend: str, status: str, reason: str = "", seconds: float = 0.0, family: str | None = None,
            **more: object) -> None:
    path = os.environ.get("PROBES_ZOO_MATRIX")
    if path:
        row = {"lane": LANE, "torch": torch.__version__.split("+")[0], "arch": arch,
               "family": family or ARCHITECTURES[arch].family,
               "backend": backend, "status": status, "reason": reason[:300], "seconds": round(seconds, 1),
               **more}
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(row) + "\n")


def _backends() -> list[str]:
    backends = ["eager", "compile"]
    if LANE != "modern":
        backends.insert(1, "ort")
    return backends


TORCH_24 = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5)

_EAGER: dict[str, tuple[Run, Run, Path]] = {}
# The probed run's dump of each (architecture, backend) trained so far (the coverage test reads them).
_PROBED: dict[tuple[str, str], Path] = {}


def _eager(arch: Architecture, root: Path) -> tuple[Run, Run, Path]:
    """Eager without and with probes, once per architecture (every backend compares against them)."""
    if arch.name not in _EAGER:
        out = root / f"{arch.name}-eager"
        _EAGER[arch.name] = (train(arch, "eager", None), train(arch, "eager", out), out)
    return _EAGER[arch.name]


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _assert_same_training(plain: Run, probed: Run, exact: bool) -> None:
    if exact:
        assert probed.losses == plain.losses
        assert plain.grads.keys() == probed.grads.keys()
        for name, grad in plain.grads.items():
            assert torch.equal(grad, probed.grads[name]), name
        return
    torch.testing.assert_close(torch.tensor(probed.losses), torch.tensor(plain.losses), rtol=1e-6, atol=1e-7)
    assert plain.grads.keys() == probed.grads.keys()
    for name, grad in plain.grads.items():
        torch.testing.assert_close(probed.grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _only_tied_gradients_differ(plain: Run, probed: Run) -> bool:
    differ = {name for name, grad in plain.grads.items() if not torch.equal(grad, probed.grads.get(name, grad + 1))}
    return probed.losses == plain.losses and bool(differ) and differ <= probed.tied


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("arch_name", list(ARCHITECTURES))
def test_zoo_trains_identically_with_probes(arch_name, backend, zoo_root):
    try:
        _check(arch_name, backend, zoo_root)
    except (AssertionError, Exception) as error:
        if not isinstance(error, pytest.skip.Exception):
            _record(arch_name, backend, "failed", f"{type(error).__name__}: {str(error).strip()[:200]}")
        raise


def _check(arch_name: str, backend: str, zoo_root: Path) -> None:
    arch = ARCHITECTURES[arch_name]
    started = time.perf_counter()
    eager_plain, eager_probed, eager_out = _eager(arch, zoo_root)
    _PROBED[(arch_name, "eager")] = eager_out
    if backend == "eager":
        _assert_same_training(eager_plain, eager_probed, exact=True)
        _record(arch_name, backend, "ok", seconds=time.perf_counter() - started)
        return
    if backend == "ort":
        os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    try:
        plain = train(arch, backend, None)
    except Exception as error:  # the backend cannot run this model at all: not ours to prove
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        _record(arch_name, backend, "fails without probes", reason)
        pytest.skip(f"{backend} fails on {arch_name} without probes too: {reason[:200]}")
    out = zoo_root / f"{arch_name}-{backend}"
    probed = train(arch, backend, out)
    _PROBED[(arch_name, backend)] = out
    # Exactly equal where probes are identities in the same program; ORT and inductor may plan kernels
    # around the opaque probe nodes differently, so there the values agree to float32 rounding.
    exact = backend == "compile" and COMPILE_BACKEND == "aot_eager"
    note = ""
    if exact and TORCH_24 and _only_tied_gradients_differ(plain, probed):
        # torch 2.4's dynamo lifts the parameters of a module with hooks otherwise than those of a module
        # without: a parameter used in three places (T5's shared embedding) gets its gradient summed in
        # another order. Any hook does that, so the same model with a hook that does nothing on every
        # module must train exactly as with probes.
        note = (f"torch 2.4 sums the gradient of {', '.join(sorted(probed.tied))} (a parameter used in several "
                "places) in another order when modules have hooks, any hook: probes train bit for bit as the "
                "model with a hook that does nothing on each module, which differs from it without hooks in "
                "the last bits")
        plain = train(arch, backend, None, hooked=True)
    _assert_same_training(plain, probed, exact=exact)
    if backend == "ort":
        assert probed.by_ort > 0, "ORT's runtime never called a probe: the probed run did not run in ORT"
    if backend == "compile":
        # A model whose own forward breaks the graph makes dynamo resume every frame on the stack, the
        # root's forward wrapper too: the root's output probes then run in one small graph of their own
        # (docs/compile.md). Otherwise probes add no graph; they never add a break of their own.
        extra = 1 if plain.breaks else 0
        assert probed.graphs <= plain.graphs + extra, (probed.graphs, plain.graphs)
        assert set(probed.reasons) <= set(plain.reasons), (probed.reasons, plain.reasons)
    if arch.draws and backend == "ort":
        _assert_same_training(plain, probed, exact=True)  # ORT's own draws: the same with probes as without
        note = ("the forward draws random numbers, which ORT draws from its own generator: training with probes "
                "equals training without bit for bit; eager against ORT is not compared")
    else:
        assert_parity(eager_out, out)
    _record(arch_name, backend, "ok, note" if note else "ok", note, seconds=time.perf_counter() - started)


@dataclass
class Output:
    """One floating-point tensor a module returned in the plain eager run, and whether a gradient reached it after the
    module returned it."""

    name: str  # its record's name: <module>[#<call>].output.<k>
    gradient: bool = False


class _Witness(torch.autograd.Function):
    """An identity on one returned tensor whose backward says that a gradient reached it: what a module's caller
    differentiates, as a probe sees it (a gradient a module's own code takes from its output before returning it,
    as a loss computed inside the forward, reaches the tensor but not what the module returned)."""

    @staticmethod
    def forward(ctx, output: Output, tensor: torch.Tensor) -> torch.Tensor:
        ctx.output = output
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> tuple[None, torch.Tensor | None]:
        if grad is not None:
            ctx.output.gradient = True
        return None, grad


def _views_of_one_another(leaves: list[torch.Tensor]) -> set[int]:
    """The places of floating-point tensors that are views of one another (distinct tensors, one memory): probes give
    them a forward record only (probes/core/aliases.py), so the reference differentiates none of them."""
    roots = [leaf if leaf._base is None else leaf._base for leaf in leaves]
    places: set[int] = set()
    for k, leaf in enumerate(leaves):
        if leaf.is_floating_point() and any(roots[j] is roots[k] and leaves[j] is not leaf for j in range(len(leaves))):
            places.add(k)
    return places


def module_outputs(arch: Architecture) -> list[Output]:
    """Every floating-point tensor each module (the root too) returns in the first step of a plain eager run, in the
    probes' naming, with whether a gradient reached it after the module returned it (a witness Function on each,
    at the first place of a tensor returned at several; none on views of one another)."""
    model = arch.build(seed=0, attention=ATTENTION)
    names = {module: name or "<root>" for name, module in model.named_modules()}
    calls: collections.Counter = collections.Counter()
    outputs: list[Output] = []

    def hook(module: torch.nn.Module, args: object, result: object) -> object:
        name, call = names[module], calls[module]
        calls[module] += 1
        base = name if call == 0 else f"{name}#{call}"
        flat, spec = pytree.tree_flatten(result)
        leaves = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        views = _views_of_one_another(leaves)
        witnessed: dict[int, torch.Tensor] = {}
        for k, tensor in enumerate(leaves):
            if not tensor.is_floating_point():
                continue
            output = Output(f"{base}.output.{k}")
            outputs.append(output)
            if tensor.requires_grad and k not in views and id(tensor) not in witnessed:
                witnessed[id(tensor)] = _Witness.apply(output, tensor)
        if not witnessed:
            return None
        return pytree.tree_unflatten([witnessed.get(id(leaf), leaf) if isinstance(leaf, torch.Tensor) else leaf
                                      for leaf in flat], spec)

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    try:
        with arch.autocast():
            loss = arch.loss(model, arch.batch(0))
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return outputs


_OUTPUTS: dict[str, list[Output]] = {}


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("arch_name", list(ARCHITECTURES))
def test_zoo_records_every_module_output(arch_name, backend, zoo_root):
    if (arch_name, backend) not in _PROBED:  # run alone (-k): train it as the test above does
        try:
            _check(arch_name, backend, zoo_root)
        except AssertionError:
            pass  # the test above reports that; here only the records count
    if (arch_name, backend) not in _PROBED:
        pytest.skip(f"{backend} does not run {arch_name} (see test_zoo_trains_identically_with_probes)")
    if arch_name not in _OUTPUTS:
        _OUTPUTS[arch_name] = module_outputs(ARCHITECTURES[arch_name])
    expected = _OUTPUTS[arch_name]
    table = load_table(_PROBED[(arch_name, backend)], columns=["step", "name", "phase"]).to_pydict()
    recorded = {(name, phase) for step, name, phase in zip(table["step"], table["name"], table["phase"]) if step == 0}
    forward = [output.name for output in expected if (output.name, "forward") not in recorded]
    backward = [output.name for output in expected if output.gradient and (output.name, "backward") not in recorded]
    with_gradient = sum(output.gradient for output in expected)
    _record(arch_name, backend, "coverage", kind="coverage", forward=[len(expected) - len(forward), len(expected)],
            backward=[with_gradient - len(backward), with_gradient],
            missing=(forward + [f"{name} (backward)" for name in backward])[:12])
    assert not forward, f"{len(forward)} of {len(expected)} module outputs have no forward record: {forward}"
    assert not backward, f"{len(backward)} of {with_gradient} gradients have no backward record: {backward}"
