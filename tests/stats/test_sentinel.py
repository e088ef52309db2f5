"""The anomaly sentinel: the first nan/inf at a known step and module, in eager, ORTModule and torch.compile.

A NaN (or inf) is injected with ``inject_bug(..., factor=nan)`` into one layer from a known step; the
sentinel must name that rank, step, phase, module and tensor, with the counts, raise at the end of that
forward or backward, keep the dump of that step and the ones before it, and change nothing while the
values are finite.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import called_by_ort_runtime
from probes import AnomalyError, AnomalySentinel, StatisticsSubscriber, SubscriberManager, load_dump
from probes.cli import main as probes_main
from probes.dump import first_anomaly
from probes.dump.anomaly import record_anomaly
from probes.dump.reader import list_steps
from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.stats import AnomalyWarning
from probes.testing import inject_bug

CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
LAYER = "blocks.1.mlp.0"
BAD_STEP = 3


def run(model, steps, *, bug=None, on_error=None):
    """Trains ``steps`` steps; returns (losses, the step and error of the first exception, or None)."""
    losses = []
    for step in range(steps):
        if bug is not None:
            bug.step = step
        batch = make_batch(CONFIG, batch_size=2, seed=step)
        try:
            loss = model(batch["tokens"], labels=batch["labels"])
            loss.backward()
        except AnomalyError as error:
            return losses, (step, error)
        losses.append(loss.item())
    return losses, None


def fresh_model():
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


def check_anomaly(error, phase, *, nan=None, inf=None):
    anomaly = error.anomaly
    assert (anomaly.rank, anomaly.step, anomaly.phase) == (0, BAD_STEP, phase)
    assert (anomaly.module, anomaly.tensor_index, anomaly.name) == (LAYER, 0, f"{LAYER}.output.0")
    numel = 2 * CONFIG.seq_len * CONFIG.d_ff  # the layer's output: batch x seq x d_ff
    assert anomaly.numel == numel
    assert (anomaly.nan, anomaly.inf) == (numel if nan else 0, numel if inf else 0)
    text = str(error)
    assert f"rank 0, step {BAD_STEP}, {phase}, {LAYER}.output.0 (module {LAYER}, tensor 0)" in text
    assert f"{anomaly.nan} nan, {anomaly.inf} inf of {numel} elements" in text


@pytest.mark.parametrize("with_statistics", [False, True], ids=["sentinel", "statistics"])
def test_forward_nan_raises_at_the_end_of_that_forward(tmp_path, with_statistics):
    model = fresh_model()
    bug = inject_bug(model, LAYER, step=BAD_STEP, factor=math.nan)
    subscriber = (StatisticsSubscriber(tmp_path / "run", on_anomaly="raise") if with_statistics
                  else AnomalySentinel(action="raise"))
    with SubscriberManager().subscribe(model, [subscriber]):
        losses, caught = run(model, 6, bug=bug)
    assert caught is not None and caught[0] == BAD_STEP and len(losses) == BAD_STEP
    check_anomaly(caught[1], "forward", nan=True)
    assert "raised at the end of the forward" in str(caught[1])
    assert model.training and all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_backward_inf_raises_out_of_backward(tmp_path):
    model = fresh_model()
    sentinel = AnomalySentinel(action="raise")
    with SubscriberManager().subscribe(model, [sentinel]):
        bug = inject_bug(model, LAYER, step=BAD_STEP, factor=math.inf, phase="backward")  # after subscribing
        losses, caught = run(model, 6, bug=bug)
    assert caught is not None and caught[0] == BAD_STEP and len(losses) == BAD_STEP
    check_anomaly(caught[1], "backward", inf=True)
    assert "raised at the end of the backward" in str(caught[1])
    assert sentinel.first == caught[1].anomaly


def test_the_ring_buffer_keeps_the_anomalous_step_and_the_ones_before_it(tmp_path):
    clean = fresh_model()
    with SubscriberManager().subscribe(clean, [StatisticsSubscriber(tmp_path / "clean", keep_last=2)]):
        run(clean, 6)
    assert list_steps(tmp_path / "clean") == {0: {"finished": [4, 5], "unfinished": []}}

    model = fresh_model()
    bug = inject_bug(model, LAYER, step=BAD_STEP, factor=math.nan)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / "run", keep_last=2,
                                                                    on_anomaly="raise")]):
        _, caught = run(model, 6, bug=bug)
        assert caught[0] == BAD_STEP
        assert str(tmp_path / "run") in str(caught[1])
        # When the error arrives, the anomalous step's records are on disk already (unfinished).
        assert list_steps(tmp_path / "run") == {0: {"finished": [1, 2], "unfinished": [BAD_STEP]}}
    assert list_steps(tmp_path / "run") == {0: {"finished": [1, 2, BAD_STEP], "unfinished": []}}
    records = load_dump(tmp_path / "run")
    first = first_anomaly(records)
    assert (first.step, first.phase, first.name) == (BAD_STEP, "forward", f"{LAYER}.output.0")
    assert all(record_anomaly(r) is None for r in records if r["step"] < BAD_STEP)


def test_warn_mode_warns_once_and_training_goes_on(tmp_path):
    model = fresh_model()
    bug = inject_bug(model, LAYER, step=BAD_STEP, factor=math.nan)
    sentinel = AnomalySentinel(action="warn")
    with SubscriberManager().subscribe(model, [sentinel]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, error = run(model, 6, bug=bug)
    assert error is None and len(losses) == 6 and math.isnan(losses[-1])
    anomaly_warnings = [w for w in caught if issubclass(w.category, AnomalyWarning)]
    assert len(anomaly_warnings) == 1 and f"step {BAD_STEP}, forward, {LAYER}.output.0" in str(anomaly_warnings[0].message)
    assert sentinel.first.step == BAD_STEP and sentinel.found > 3  # every later step has nan records too


def test_max_abs_flags_finite_values_beyond_it():
    for max_abs, expected in ((None, None), (65504.0, BAD_STEP)):
        model = fresh_model()
        bug = inject_bug(model, LAYER, step=BAD_STEP, factor=1e7)  # finite, beyond float16's range
        sentinel = AnomalySentinel(action="warn", max_abs=max_abs)
        with SubscriberManager().subscribe(model, [sentinel]), warnings.catch_warnings():
            warnings.simplefilter("ignore", AnomalyWarning)
            run(model, 5, bug=bug)
        assert (sentinel.first.step if sentinel.first else None) == expected
        if expected is not None:
            first = sentinel.first
            assert first.over and first.largest > 65504 and (first.nan, first.inf) == (0, 0)
            assert first.name == f"{LAYER}.output.0" and "> max_abs 65504" in str(first)


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="'warn' or 'raise'"):
        AnomalySentinel(action="stop")
    with pytest.raises(ValueError, match="max_abs must be a finite number > 0"):
        AnomalySentinel(max_abs=-1)
    with pytest.raises(ValueError, match="max_abs needs on_anomaly"):
        StatisticsSubscriber(tmp_path / "a", max_abs=10.0)
    with pytest.raises(ValueError, match="keep_last"):
        StatisticsSubscriber(tmp_path / "b", keep_last=0)


def test_nothing_changes_while_nothing_is_found(tmp_path):
    def train(subscribers):
        model = fresh_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, grads = [], []
        with SubscriberManager().subscribe(model, subscribers) if subscribers else _null():
            for step in range(3):
                batch = make_batch(CONFIG, batch_size=2, seed=step)
                loss = model(batch["tokens"], labels=batch["labels"])
                loss.backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        return losses, grads

    plain = train([])
    for subscribers in ([AnomalySentinel()], [StatisticsSubscriber(tmp_path / "s", on_anomaly="raise", keep_last=1)]):
        losses, grads = train(subscribers)
        assert losses == plain[0]
        assert all(torch.equal(a, b) for step_a, step_b in zip(grads, plain[1]) for a, b in zip(step_a, step_b))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_compiled_forward_nan_raises():
    torch._dynamo.reset()
    model = fresh_model()
    bug = inject_bug(model, LAYER, step=BAD_STEP, factor=math.nan)
    with SubscriberManager().subscribe(model, [AnomalySentinel()]):
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        losses, caught = run(compiled, 6, bug=bug)
    torch._dynamo.reset()
    assert caught is not None and caught[0] == BAD_STEP
    check_anomaly(caught[1], "forward", nan=True)


@pytest.mark.ort
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_ortmodule_raises_the_anomaly_by_its_own_type(tmp_path, monkeypatch, phase):
    from onnxruntime.training.ortmodule import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = fresh_model()
    bug = inject_bug(model, LAYER, step=BAD_STEP, factor=math.nan) if phase == "forward" else None
    by_ort = []

    class ProvesOrt(AnomalySentinel):
        def on_event(self, event):
            if event.kind == "forward":
                by_ort.append(called_by_ort_runtime())
            super().on_event(event)

    subscription = SubscriberManager().subscribe(
        model, [StatisticsSubscriber(tmp_path / "run", keep_last=2, on_anomaly="raise"), ProvesOrt(action="warn")])
    if bug is None:
        bug = inject_bug(model, LAYER, step=BAD_STEP, factor=math.nan, phase="backward")
    with subscription, warnings.catch_warnings():
        warnings.simplefilter("ignore", AnomalyWarning)
        losses, caught = run(ORTModule(model), 6, bug=bug)
    assert by_ort and all(by_ort)  # every probe call was made by ORT's runtime
    assert caught is not None and caught[0] == BAD_STEP and len(losses) == BAD_STEP
    check_anomaly(caught[1], phase, nan=True)
    assert "raised at the end of the backward" in str(caught[1])  # a forward one too: see sentinel.py
    assert list_steps(tmp_path / "run")[0]["finished"] == [1, 2, BAD_STEP]


def test_show_and_compare_say_which_rank_saw_the_first_nonfinite_value(tmp_path, capsys):
    def record(rank, step, seq, name, nan=0):
        return {"rank": rank, "step": step, "phase": "forward", "seq": seq, "name": name, "module": name,
                "tensor_index": 0, "numel": 4, "nan": nan, "inf": 0, "min": -1.0, "max": 1.0}

    for rank in (0, 1):
        with DumpWriter(tmp_path / "run", rank=rank) as writer:
            for step in range(3):
                for seq, name in enumerate(("a.output.0", "b.output.0")):
                    bad = rank == 1 and step >= 1 and name == "b.output.0" or rank == 0 and step == 2
                    write_record(writer, step, record(rank, step, seq, name, nan=2 if bad else 0))
                writer.finish_step(step)
    assert probes_main(["show", str(tmp_path / "run"), "--anomalies"]) == 0
    out = capsys.readouterr().out
    assert "first non-finite value: rank 1, step 1, forward, b.output.0 (module b.output.0, tensor 0): 2 nan" in out
    assert out.count("b.output.0") >= 3 and "a.output.0" in out  # rank 0's step 2 a.output.0 is anomalous too


@pytest.mark.slow
def test_the_anomalous_step_is_finished_when_the_error_ends_the_process(tmp_path):
    script = f"""
import math, torch
from probes import StatisticsSubscriber, SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch
from probes.testing import inject_bug
config = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=2, d_ff=32, seq_len=8)
torch.manual_seed(0)
model = TinyTransformer(config)
bug = inject_bug(model, {LAYER!r}, step={BAD_STEP}, factor=math.nan)
SubscriberManager.subscribe(model, [StatisticsSubscriber({str(tmp_path / 'run')!r}, keep_last=2, on_anomaly="raise")])
for step in range(6):
    bug.step = step
    batch = make_batch(config, batch_size=2, seed=step)
    model(batch["tokens"], labels=batch["labels"]).backward()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 1 and "AnomalyError: probes: anomaly at rank 0, step 3, forward" in done.stderr
    assert list_steps(tmp_path / "run") == {0: {"finished": [1, 2, BAD_STEP], "unfinished": []}}


def test_compare_reports_where_each_run_saw_its_first_nonfinite_value(tmp_path, capsys):
    for label, bad in (("clean", None), ("bad", BAD_STEP)):
        model = fresh_model()
        bug = inject_bug(model, LAYER, step=bad if bad is not None else 99, factor=math.nan)
        with SubscriberManager().subscribe(model, [StatisticsSubscriber(tmp_path / label)]):
            run(model, 5, bug=bug)
    assert probes_main(["compare", str(tmp_path / "clean"), str(tmp_path / "bad"), "--json",
                        str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "  base: none" in out
    assert f"  other: rank 0, step {BAD_STEP}, forward, {LAYER}.output.0 (module {LAYER}, tensor 0): " in out
    import json
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_nonfinite"]["base"] is None
    assert report["first_nonfinite"]["other"]["step"] == BAD_STEP and report["first_nonfinite"]["other"]["nan"] > 0
