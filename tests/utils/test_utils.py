"""The shared ground: the undo handle, the int check, pytree tensor leaves, text tables, the exit sequence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import namedtuple

import pytest
import torch

from exporters.handles import Handle
from probes.utils.checks import check_int
from probes.utils.tables import printable, text_table
from probes.utils.tree import TensorLeaves, lone_tensor


def test_handle_undoes_once_and_is_a_context_manager() -> None:
    calls = []
    handle = Handle(lambda: calls.append("undo"))
    assert handle.active
    handle.remove()
    handle.remove()
    assert calls == ["undo"] and not handle.active
    with Handle(lambda: calls.append("with")) as inner:
        assert inner.active
    assert calls == ["undo", "with"]


def test_chained_handles_undo_last_first() -> None:
    calls = []
    chain = Handle.chain([Handle(lambda: calls.append(1)), Handle(lambda: calls.append(2))])
    chain.remove()
    chain.remove()
    assert calls == [2, 1]


@pytest.mark.parametrize("value", [-1, True, 1.0, "3", None])
def test_check_int_refuses_what_is_not_a_count(value) -> None:
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got"):
        check_int(value, "step")


def test_check_int_minimum() -> None:
    assert check_int(0, "step") == 0
    assert check_int(5, "size", minimum=1) == 5
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        check_int(0, "size", minimum=1)
    with pytest.raises(ValueError, match="n must be an int >= 3, got 2"):
        check_int(2, "n", minimum=3)


def test_tensor_leaves_replace_tensors_in_place_and_keep_the_rest() -> None:
    Pair = namedtuple("Pair", "a b")
    a, b, c = torch.ones(1), torch.zeros(2), torch.arange(3)
    structure = {"x": [a, 3, None], "y": Pair(b, "s"), "z": c}
    leaves = TensorLeaves.of(structure)
    assert [t.shape for t in leaves.tensors] == [torch.Size([1]), torch.Size([2]), torch.Size([3])]
    rebuilt = leaves.rebuild([t + 1 for t in leaves.tensors])
    assert rebuilt["x"][1:] == [3, None] and isinstance(rebuilt["y"], Pair) and rebuilt["y"].b == "s"
    assert torch.equal(rebuilt["x"][0], a + 1) and torch.equal(rebuilt["y"].a, b + 1) and torch.equal(rebuilt["z"], c + 1)
    floats = TensorLeaves.of(structure, select=lambda leaf: isinstance(leaf, torch.Tensor) and leaf.is_floating_point())
    assert len(floats.tensors) == 2


def test_lone_tensor_is_the_place_of_the_one_plain_tensor_among_scalars() -> None:
    t = torch.ones(2)
    assert lone_tensor((t, None, 3)) == 0 and lone_tensor((None, "s", t, 1.5, True)) == 2
    assert lone_tensor((t, t)) is None and lone_tensor((t, torch.zeros(1))) is None  # two tensors: may share memory
    assert lone_tensor((t, [None])) is None and lone_tensor((t, (None,))) is None  # a nested structure
    assert lone_tensor((torch.nn.Parameter(t), None)) is None  # a subclass is no plain tensor
    assert lone_tensor(()) is None and lone_tensor((None, 3)) is None
    leaves = TensorLeaves.of((None, t, 3))  # what the general path would select
    assert leaves.positions == [lone_tensor((None, t, 3))]


def test_text_table_aligns_columns_and_printable_escapes_control_characters() -> None:
    lines = text_table(["name", "n"], [["a", "1"], ["long", "100"]], right={1})
    assert lines == ["name    n", "a       1", "long  100"]
    assert printable("a\x1b[31mb\n") == "a\\x1b[31mb\\n"


def test_exit_stages_run_in_order_and_removed_callbacks_do_not_run() -> None:
    script = textwrap.dedent("""
        from probes.utils.exit import at_exit
        at_exit("writers", lambda: print("writers"))
        at_exit("subscriptions", lambda: print("subscriptions"))
        at_exit("exiting", lambda: print("exiting"))
        at_exit("writers", lambda: print("never")).remove()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["exiting", "subscriptions", "writers"]
    with pytest.raises(ValueError, match="unknown exit stage"):
        from probes.utils.exit import at_exit
        at_exit("later", lambda: None)
