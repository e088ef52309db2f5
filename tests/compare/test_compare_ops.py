"""Op records in compare: nested under their module in every report, the first diverging operation told local from
propagated by its inputs' records, operations of one run only paired where decompositions differ.

The dumps are written here from a small attention computed in float64 with autograd (``attention_records``):
the records an op-level subscription writes for it, with the names and ``inputs`` of docs/compare.md
(Operations inside a module); a bug is a factor on one tensor, so everything computed from it differs too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import torch

from probes.cli import main
from probes.compare import compare_dumps, format_report
from probes.compare.html import HtmlConfig, render_html
from probes.compare.results import (AGREES, DIFFERS, NO_RECORD, UNPAIRED, Check, OpFinding, module_record, op_name,
                                    relative_name)
from probes.compare.terminal import verdict
from probes.dump.writer import DumpWriter
from dump_records import write_record
from probes.stats.recorder import tensor_record

M = "blocks.0.attn"


def attention_records(step: int, *, bug: dict[str, float] | None = None, decompose: bool = False,
                      extra: bool = False, gradient_bug: str | None = None, loss: float = 1.0,
                      calls: int = 1, unused: bool = False, child: bool = False) -> list[dict]:
    """The forward and backward records of ``calls`` calls of an attention module ``M`` in one step: its input,
    its operations (linear q, k, v; einsum scores; softmax; einsum with v; linear out), its output.

    ``bug``: record name -> factor on that tensor (everything after it computed from the changed value);
    ``decompose``: the scores by ``matmul`` (the second einsum is then ``einsum:0``); ``extra``: an extra
    ``mul`` by 1 after the softmax; ``gradient_bug``: the op whose output's gradient, as it flows on, is scaled
    by 1.01 (the backward of the operations that used it is wrong; its own gradient record is right); ``loss``:
    a factor on the loss (every gradient differs from the module's output on); ``unused``: an extra ``linear``
    after the first, of another shape, whose output is not used (no gradient: no backward record); ``child``: q
    is the output of a submodule ``q_proj`` too (whose operations are not recorded apart), and the scores take
    that record as their input."""
    bug = bug or {}
    made: list[tuple[str, str, torch.Tensor, list[str] | None]] = []
    weights = [torch.randn(8, 8, generator=torch.Generator().manual_seed(10 + i), dtype=torch.float64) / 3
               for i in range(4)]
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(step), dtype=torch.float64, requires_grad=True)
    hidden = x
    for call in range(calls):
        suffix = f"#{call}" if call else ""
        counts: dict[str, int] = {}

        def op(kind: str, tensor: torch.Tensor, inputs: list[str]) -> tuple[torch.Tensor, str]:
            index = counts[kind] = counts.get(kind, -1) + 1
            name = f"{M}/{kind}:{index}{suffix}.output.0"
            tensor = tensor * bug.get(name, 1.0)
            if gradient_bug == name:
                tensor.register_hook(lambda grad: grad * 1.01)
            made.append((name, "op", tensor, inputs))
            return tensor, name

        entry = f"{M}{suffix}.input.0"
        inp = hidden * bug.get(entry, 1.0)
        made.append((entry, "input", inp, None))
        q, qn = op("linear", inp @ weights[0], [entry, ""])
        if child:
            qn = f"{M}.q_proj{suffix}.output.0"
            made.append((qn, "output", q, None))
        if unused:
            op("linear", inp @ weights[0][:, :4], [entry, ""])
        k, kn = op("linear", inp @ weights[1], [entry, ""])
        v, vn = op("linear", inp @ weights[2], [entry, ""])
        if decompose:
            s, sn = op("matmul", q @ k.transpose(-1, -2), [qn, kn])
        else:
            s, sn = op("einsum", torch.einsum("bqd,bkd->bqk", q, k), [qn, kn])
        p, pn = op("softmax", torch.softmax(s / math.sqrt(8), -1), [sn])
        if extra:
            p, pn = op("mul", p * 1.0, [pn, ""])
        a, an = op("einsum", torch.einsum("bqk,bkd->bqd", p, v), [pn, vn])
        o, on = op("linear", a @ weights[3], [an, ""])
        hidden = o * bug.get(f"{M}{suffix}.output.0", 1.0)
        made.append((f"{M}{suffix}.output.0", "output", hidden, None))
    value = (hidden * torch.linspace(-1, 1, 8, dtype=torch.float64)).square().mean() * loss
    grads = torch.autograd.grad(value, [tensor for _, _, tensor, _ in made], allow_unused=True)
    records = []
    for seq, (name, kind, tensor, inputs) in enumerate(made):
        records.append(_record(name, kind, "forward", seq, tensor, inputs))
    backward = [(name, kind, grad, inputs) for (name, kind, _, inputs), grad in zip(made, grads) if grad is not None]
    for seq, (name, kind, grad, inputs) in enumerate(reversed(backward), len(made)):
        records.append(_record(name, kind, "backward", seq, grad, inputs))
    return records


def _record(name: str, kind: str, phase: str, seq: int, tensor: torch.Tensor, inputs: list[str] | None) -> dict:
    module = op_name(name).module if kind == "op" else module_record(name)[0]
    record = {"name": name, "phase": phase, "seq": seq, "kind": kind, "module": module, "module_class": "Attention",
              **tensor_record(tensor.detach(), sample_count=8)}
    if inputs is not None:
        record["inputs"] = inputs
    return record


def write_dump(root: Path, per_step: dict[int, list[dict]], rank: int = 0) -> Path:
    with DumpWriter(root, rank=rank) as writer:
        for step, records in per_step.items():
            for record in records:
                write_record(writer, step, record)
            writer.finish_step(step)
    return root


def runs(tmp_path: Path, steps: int = 2, **other: object) -> tuple[Path, Path]:
    """(base, other): ``steps`` steps each; ``other``: ``attention_records``' options of the other run's step 1."""
    base = write_dump(tmp_path / "base", {step: attention_records(step) for step in range(steps)})
    changed = {step: attention_records(step, **(other if step == 1 else {})) for step in range(steps)}  # type: ignore[arg-type]
    return base, write_dump(tmp_path / "other", changed)


def op(name: str, k: int = 0, call: str = "") -> str:
    return f"{M}/{name}:{k}{call}.output.0"


# --------------------------------------------------------------------------------------------- names


def test_op_names_are_taken_apart():
    found = op_name("encoder.layers.0.self_attn/einsum:2#1.output.3")
    assert (found.module, found.call, found.op, found.index, found.output) == ("encoder.layers.0.self_attn", 1,
                                                                             "einsum", 2, 3)
    assert found.short == "einsum:2#1.output.3" and op_name("<root>/masked_fill:0.output.0").op == "masked_fill"
    assert op_name("encoder.layers.0.self_attn.output.0") is None and op_name("a/b.output.0") is None
    unpaired = op_name(op("linear", 1) + UNPAIRED)
    assert unpaired.unpaired and unpaired.short == "linear:1.output.0 (unpaired)" and not op_name(op("linear")).unpaired
    assert module_record("encoder.layers.0#2.output.1") == ("encoder.layers.0", 2)
    assert module_record("<root>.input.0") == ("<root>", 0) and module_record(op(name="linear")) is None
    assert relative_name(op("softmax"), M) == "softmax:0.output.0" and relative_name(f"{M}.output.0", M) == f"{M}.output.0"
    assert relative_name("blocks.1.attn/softmax:0.output.0", M) == "blocks.1.attn/softmax:0.output.0"


# --------------------------------------------------------------------------------------------- both sides


def test_identical_runs_with_op_records_agree_and_reports_say_nothing_of_ops(tmp_path, capsys):
    base = write_dump(tmp_path / "base", {step: attention_records(step) for step in range(2)})
    other = write_dump(tmp_path / "other", {step: attention_records(step) for step in range(2)})
    report = compare_dumps(base, other)
    assert report.agrees and report.first_operation is None and not report.renamed
    assert (report.operations.matched, report.operations.diverged, report.operations.modules) == (2 * 2 * 7, 0, [])
    assert report.to_json()["operations"]["first"] is None
    assert "operation" not in format_report(report).lower() and "Operations" not in render_html(report)


def test_a_bug_in_one_operation_is_named_there_with_its_inputs_agreeing(tmp_path, capsys):
    base, other = runs(tmp_path, bug={op("einsum"): 1.01})
    report = compare_dumps(base, other)
    first = report.first_divergence
    assert (first.step, first.phase, first.name) == (1, "forward", op("einsum"))
    found = report.first_operation
    assert found.name == op("einsum") and found.cause == "local"
    assert [(check.name, check.status) for check in found.inputs] == [(op("linear"), AGREES), (op("linear", 1), AGREES)]
    assert found.explained() == "local: the operation itself (every recorded input agrees)"
    assert verdict(report) == (f"DIVERGED at rank 0, step 1, forward, {op('einsum')} ({first.metric}); "
                               "local: the operation itself (every recorded input agrees)")

    # The operations after it differ too, each by an input that already differs.
    forward = next(group for group in report.operations.modules if group.phase == "forward")
    assert (forward.step, forward.module, forward.call) == (1, M, 0)
    assert [finding.name for finding in forward.ops] == [op("einsum"), op("softmax"), op("einsum", 1), op("linear", 3)]
    softmax = forward.ops[1]
    assert softmax.cause == "propagated" and [(c.name, c.status) for c in softmax.inputs] == [(op("einsum"), DIFFERS)]
    assert softmax.explained() == "propagated: an input already differs: einsum:0.output.0"
    later = forward.ops[2]  # the second einsum: the softmax differs, v agrees
    assert [c.status for c in later.inputs] == [DIFFERS, AGREES]
    assert [(c.name, c.status) for c in forward.records] == [(f"{M}.input.0", AGREES), (f"{M}.output.0", DIFFERS)]
    assert forward.ops[3].inputs[1].status == NO_RECORD and "parameter" in forward.ops[3].inputs[1].note

    code = main(["compare", str(base), str(other), "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html")])
    out = capsys.readouterr().out
    assert code == 1
    assert f"  operation: local: the operation itself (every recorded input agrees)" in out
    assert f"    input 0: {op('linear')} agrees" in out
    nested = out[out.index("Diverged operations"):]
    assert f"rank 0 step 1 forward  {M}  (input.0 agrees, output.0 differs" in nested
    assert "    softmax:0.output.0" in nested and "propagated: an input already differs: einsum:0.output.0" in nested
    around = out[out.index("Around the first divergence"):out.index("Worst records")]
    assert f"{M}/" in around and "  einsum:0.output.0" in around  # the ops indented under their module
    document = json.loads((tmp_path / "r.json").read_text())
    operations = document["operations"]
    assert operations["first"]["name"] == op("einsum") and operations["first"]["cause"] == "local"
    assert [check["status"] for check in operations["first"]["inputs"]] == [AGREES, AGREES]
    assert operations["modules"][0]["module"] == M and operations["modules"][0]["ops"][1]["cause"] == "propagated"
    page = (tmp_path / "r.html").read_text()
    assert "First diverging operation" in page and "Diverged operations, by module call" in page
    assert "the operation itself" in page and "propagated: an input already differs" in page


def test_a_difference_reaching_the_module_is_found_at_its_input_and_its_operations_say_propagated(tmp_path):
    base, other = runs(tmp_path, bug={f"{M}.input.0": 1.01})
    report = compare_dumps(base, other)
    assert report.first_divergence.name == f"{M}.input.0"
    found = report.first_operation  # the first diverging operation inside the module: propagated
    assert found.name == op("linear") and found.cause == "propagated"
    assert [(c.name, c.status) for c in found.inputs] == [(f"{M}.input.0", DIFFERS), ("", NO_RECORD)]
    assert report.operations.inside_first == 7
    assert "first diverging operation inside: " + op("linear") in verdict(report)


def test_a_module_output_that_differs_while_its_operations_agree_says_so(tmp_path):
    base, other = runs(tmp_path, bug={f"{M}.output.0": 1.01})
    report = compare_dumps(base, other)
    assert report.first_divergence.name == f"{M}.output.0" and report.first_operation is None
    assert report.operations.inside_first == 7
    assert "its 7 recorded operations agree" in format_report(report)


def test_a_wrong_backward_is_local_to_the_operations_that_used_the_output(tmp_path):
    base, other = runs(tmp_path, gradient_bug=op("softmax"))
    report = compare_dumps(base, other)
    first = report.first_divergence
    assert (first.step, first.phase, first.name) == (1, "backward", op("einsum"))
    found = report.first_operation
    assert found.cause == "local" and [(c.name, c.phase, c.status) for c in found.gradients] == [
        (op("softmax"), "backward", AGREES)]
    assert all(check.status == AGREES and check.phase == "forward" for check in found.inputs)
    assert found.explained().startswith("local: the backward of the operations that used it")
    backward = report.operations.modules[0]
    later = next(finding for finding in backward.ops if finding.name == op("linear"))  # q: from the scores' gradient
    assert later.cause == "propagated" and [(c.name, c.status) for c in later.gradients] == [(op("einsum"), DIFFERS)]
    assert later.explained() == "propagated: a gradient it is computed from already differs: einsum:0.output.0"


def test_a_gradient_reaching_the_module_is_found_at_its_output_and_its_last_operation_says_propagated(tmp_path):
    base, other = runs(tmp_path, loss=1.01)
    report = compare_dumps(base, other)
    first = report.first_divergence
    assert (first.step, first.phase, first.name) == (1, "backward", f"{M}.output.0")
    found = report.first_operation  # the module returned linear:3's output: its gradient is the module output's
    assert found.name == op("linear", 3) and found.cause == "propagated"
    assert [(c.name, c.status) for c in found.gradients] == [(f"{M}.output.0", DIFFERS)]
    assert found.explained() == f"propagated: a gradient it is computed from already differs: {M}.output.0"

    # q is a submodule's output too (its operation recorded in the module around it): its gradient comes from there.
    base = write_dump(tmp_path / "child", {0: attention_records(0, child=True)})
    other = write_dump(tmp_path / "child_other", {0: attention_records(0, child=True, loss=1.01)})
    backward = compare_dumps(base, other).operations.modules[0]
    q = next(finding for finding in backward.ops if finding.name == op("linear"))
    assert [(c.name, c.status) for c in q.gradients] == [(f"{M}.q_proj.output.0", DIFFERS)]
    assert [c.name for c in next(f for f in backward.ops if f.name == op("einsum")).inputs] == [
        f"{M}.q_proj.output.0", op("linear", 1)]


def test_a_run_without_provenance_takes_the_other_runs_inputs(tmp_path):
    """A compiled run records no ``inputs`` (dynamo cannot trace where a tensor came from): the other run's say."""
    compiled = {step: [{key: value for key, value in record.items() if key != "inputs"}
                       for record in attention_records(step)] for step in range(2)}
    base = write_dump(tmp_path / "compiled", compiled)
    other = write_dump(tmp_path / "eager", {step: attention_records(step, bug={op("softmax"): 1.01} if step else None)
                                            for step in range(2)})
    report = compare_dumps(base, other)
    found = report.first_operation
    assert found.name == op("softmax") and found.cause == "local"
    assert [(c.name, c.status) for c in found.inputs] == [(op("einsum"), AGREES)]
    later = report.operations.modules[0].ops[1]
    assert later.name == op("einsum", 1) and later.cause == "propagated"


# --------------------------------------------------------------------------------------------- one run only


def test_a_decomposition_is_paired_by_operation_shape_and_order(tmp_path, capsys):
    base, other = runs(tmp_path, decompose=True)
    plain = compare_dumps(base, other)
    assert plain.agrees, format_report(plain)
    assert [(r.other, r.base, r.how, r.phase) for r in plain.renamed] == [
        (op("matmul"), op("einsum"), "op", None), (op("einsum"), op("einsum", 1), "op", None)]
    assert plain.renamed[0].confidence == 0.75 and "matmul as einsum" in plain.renamed[0].reason
    assert plain.renamed[1].confidence == 1.0
    out = format_report(plain)
    assert "2 names of other renamed by operation alignment" in out and f"{op('matmul')} -> {op('einsum')} (op" in out
    assert '"how": "op"' in json.dumps(plain.to_json())

    # A bug in the decomposed operation is found at its BASE name.
    changed = write_dump(tmp_path / "buggy", {step: attention_records(step, decompose=True,
                                                                      bug={op("matmul"): 1.01} if step else None)
                                              for step in range(2)})
    report = compare_dumps(base, changed)
    assert report.first_divergence.name == op("einsum") and report.first_operation.cause == "local"


def test_an_extra_operation_of_one_run_is_listed(tmp_path):
    base, other = runs(tmp_path, extra=True)
    report = compare_dumps(base, other)
    assert report.only_in_other == [(0, 1, "forward", op("mul")), (0, 1, "backward", op("mul"))]
    assert not report.only_in_base and not report.renamed and report.diverged_count == 0
    # Listed, not a divergence: an operation that changed a result would show in the operations after it.
    assert report.first_divergence is None and report.first_operation is None and report.agrees
    assert report.ops_in_one_run == report.only_in_other
    assert "2 op records of one run only listed" in verdict(report)


def test_an_extra_operation_that_shifts_the_names_of_later_ones_is_aligned_and_listed_unpaired(tmp_path):
    base, other = runs(tmp_path, unused=True)
    report = compare_dumps(base, other)
    assert [(r.other, r.base, r.confidence) for r in report.renamed] == [
        (op("linear", 2), op("linear", 1), 1.0), (op("linear", 3), op("linear", 2), 1.0),
        (op("linear", 4), op("linear", 3), 1.0)]
    extra = op("linear", 1) + UNPAIRED
    assert report.only_in_other == [(0, 1, "forward", extra)] and not report.only_in_base
    assert report.diverged_count == 0 and report.first_divergence is None and report.agrees
    listed = next(line for line in format_report(report).splitlines() if line.startswith("1 records only in other"))
    assert listed.endswith("linear:1.output.0 (unpaired)")


def test_operations_of_a_module_called_twice_are_paired_within_their_call(tmp_path):
    base = write_dump(tmp_path / "base", {0: attention_records(0, calls=2)})
    other = write_dump(tmp_path / "other", {0: attention_records(0, calls=2, decompose=True)})
    report = compare_dumps(base, other)
    assert report.agrees
    assert {(r.other, r.base) for r in report.renamed} == {
        (op("matmul", 0, call), op("einsum", 0, call)) for call in ("", "#1")} | {
        (op("einsum", 0, call), op("einsum", 1, call)) for call in ("", "#1")}


# --------------------------------------------------------------------------------------------- windows


def test_windows_report_ops_exactly_as_one_read(tmp_path):
    def steps(**options):
        return {step: attention_records(step, **(options if step in (2, 4) else {})) for step in range(6)}

    for rank in (0, 1):
        write_dump(tmp_path / "base", steps(), rank)
        write_dump(tmp_path / "other", steps(bug={op("einsum"): 1.001}, decompose=True), rank)  # base's einsum:1
    whole = compare_dumps(tmp_path / "base", tmp_path / "other", window=None)
    assert whole.first_operation.name == op("einsum", 1) and len(whole.operations.modules) == 2 * 2 * 2
    assert [r.how for r in whole.renamed] == ["op", "op"]
    for jobs in (1, 2):
        windowed = compare_dumps(tmp_path / "base", tmp_path / "other", window=30, jobs=jobs)
        assert windowed.to_json() == whole.to_json()
        assert format_report(windowed) == format_report(whole)
        assert render_html(windowed) == render_html(whole)


def test_the_page_counts_the_operation_rows_it_leaves_out(tmp_path):
    base, other = runs(tmp_path, bug={f"{M}.input.0": 1.01})
    report = compare_dumps(base, other)
    total = sum(1 + len(group.ops) for group in report.operations.modules)
    for limit in (2, 5, total - 1, total, total + 5):
        page = render_html(report, HtmlConfig(max_rows=limit))
        section = page[page.index('id="operations"'):]
        section = section[:section.index("</table>") + 200]
        rows = section.count('<tr class="module">') + section.count('<tr class="op">')
        more = re.search(r"(\d+) more rows in the JSON report \(operations\)", section)
        assert rows + (int(more.group(1)) if more else 0) == total, limit


def test_the_cause_weighs_how_much_each_input_already_differs():
    """Issue 47: an input a little below its tolerance and the output a little above is an amplified difference
    (propagated); only a jump of over ``JUMP`` (10) times every input's ratio is the operation's own (local)."""
    def finding(ratio: float, *inputs: Check, phase: str = "forward", gradients: tuple[Check, ...] = ()) -> OpFinding:
        return OpFinding(0, 1, phase, f"{M}/addmm:0.output.0", 5, "norm", ratio, inputs, gradients)

    below = Check("h.0.output.0", "forward", AGREES, ratio=0.9)
    amplified = finding(1.75, below, Check("", "forward", NO_RECORD))
    assert amplified.cause == "propagated", amplified.explained()
    assert amplified.explained() == ("propagated: an input within tolerance already carries a difference within 10x "
                                     "of its ratio 1.75: h.0.output.0 (ratio 0.9)")
    assert finding(9.0, below).cause == "propagated"
    assert finding(9.1, below).cause == "local"  # a jump: over ten times what any input carried
    beyond = Check("h.0.output.0", "forward", DIFFERS, "std", 1.2)
    jump = finding(1e4, beyond)
    assert jump.cause == "local"
    assert jump.explained() == ("local: the operation itself (its recorded inputs differ by at most ratio 1.2, over "
                                "10x below its 1e+04)")
    assert finding(11.0, beyond).cause == "propagated"
    assert finding(11.0, Check("x", "forward", DIFFERS, "record", math.inf)).cause == "propagated"
    backward = finding(50.0, Check("x", "forward", AGREES, ratio=0.01), phase="backward",
                       gradients=(Check("y", "backward", AGREES, ratio=6.0),))
    assert backward.cause == "propagated"
    assert backward.explained() == ("propagated: a gradient it is computed from within tolerance already carries a "
                                    "difference within 10x of its ratio 50: y (ratio 6)")


def test_the_cause_weighs_relative_differences_where_ratios_are_under_unlike_tolerances():
    """A tolerance depends on the metric and the tensor's size: a scalar divisor 1% off breaks at ratio 99, the
    division it makes 1% off at ratio 1000. Relative to their magnitudes both differ by 0.0099: the division
    carries the divisor's difference (propagated); only a jump of over ``JUMP`` in both measures is local."""
    def division(rel_error: float | None, *inputs: Check) -> OpFinding:
        return OpFinding(0, 0, "forward", f"{M}/div:0.output.0", 5, "norm", 1000.0, inputs, rel_error=rel_error)

    divisor = Check(f"{M}/full:0.output.0", "forward", DIFFERS, "min", 99.0, rel_error=0.0099)
    assert division(0.0099, divisor).cause == "propagated", division(0.0099, divisor).explained()
    assert division(0.0099, replace(divisor, rel_error=None)).cause == "local"  # by ratio alone: 99 < 1000 / 10
    assert division(None, divisor).cause == "local"  # in one run only: nothing to weigh against
    assert division(0.098, divisor).cause == "propagated"  # within 10x: still amplified
    assert division(0.11, divisor).cause == "local"  # over 10x in both measures: a jump
    rounding = Check("h.0.output.0", "forward", AGREES, ratio=0.5, rel_error=1e-3)
    assert division(0.0099, rounding).explained() == (
        "propagated: an input within tolerance already carries a difference within 10x of its ratio 1e+03: "
        "h.0.output.0 (relative difference 0.001, its own 0.0099)")
    assert division(0.0099, replace(rounding, rel_error=0.0)).cause == "local"  # identical carries nothing
    assert rounding.to_json()["rel_error"] == 1e-3 and "rel_error" not in replace(rounding, rel_error=None).to_json()


def test_an_operation_that_reads_no_tensor_is_local_only_when_its_run_said_so():
    """A constant or a random draw made in the module (its run recorded an empty input list) can only differ where
    it is made: local. A compiled run records no inputs at all: there nothing tells, so the cause stays unknown."""
    draw = OpFinding(0, 0, "forward", f"{M}/rand:0.output.0", 3, "mean", 40.0, (), reads_nothing=True)
    assert draw.cause == "local"
    assert draw.explained() == "local: the operation itself (it reads no tensor: a constant or a random draw made here)"
    assert OpFinding(0, 0, "forward", f"{M}/rand:0.output.0", 3, "mean", 40.0, ()).cause == "unknown"
    gradient = OpFinding(0, 0, "backward", f"{M}/rand:0.output.0", 3, "mean", 40.0, (), reads_nothing=True)
    assert gradient.cause == "unknown"  # a gradient is computed from what took it on, none of them recorded here
