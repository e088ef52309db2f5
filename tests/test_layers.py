"""The floors of the house: which package may import which, and no import cycle anywhere.

Reads every import statement of probes/ and exporters/ (module level, inside functions and under
``if TYPE_CHECKING:`` alike: a lazy import is still an arrow, and so is an import for annotations only,
which a reader follows as any other) and checks it against the layer table of docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("probes", "exporters")

# Room -> floor. A module may import its own room and rooms on lower floors, nothing else.
# The longest matching prefix names a module's room. Kept in step with docs/design.md's diagram.
FLOORS: dict[str, int] = {
    "exporters.handles": 0,
    "exporters.adapters": 1,
    "exporters.adapters.torch_internals": 1,
    "exporters.adapters.ort_internals": 1,
    "exporters.adapters.deepspeed_internals": 1,
    "exporters": 2,
    "probes.utils": 3,
    "probes.core": 4,
    "probes.dump": 4,
    "probes.models": 4,
    "probes.stats": 5,
    "probes.compare": 5,
    "probes.sinks": 5,
    "probes.rounding": 5,
    "probes.zero3": 6,
    "probes.testing": 6,
    "probes.replay": 6,
    "probes.config": 6,
    "probes.integrations": 7,
    "probes.cli": 7,
    "probes.demo": 7,
    "probes": 8,  # the package's front door, ``python -m probes`` and the kept old module names
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def room_of(module: str) -> str | None:
    candidates = [room for room in FLOORS if module == room or module.startswith(room + ".")]
    return max(candidates, key=len) if candidates else None


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports (a package's ``from pkg import submodule`` counts as the submodule)."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "exporters.zero3.thing" -> "exporters.zero3"
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_has_a_room(graph: dict[str, set[str]]) -> None:
    assert [module for module in graph if room_of(module) is None] == []


def test_exporters_never_import_probes(graph: dict[str, set[str]]) -> None:
    offending = {module: sorted(t for t in targets if t.split(".")[0] == "probes")
                 for module, targets in graph.items() if module.split(".")[0] == "exporters"}
    assert {module: targets for module, targets in offending.items() if targets} == {}


def test_imports_point_down(graph: dict[str, set[str]]) -> None:
    upward = []
    for module, targets in graph.items():
        room = room_of(module)
        for target in targets:
            target_room = room_of(target)
            if target_room != room and FLOORS[target_room] >= FLOORS[room]:
                upward.append(f"{module} (floor {FLOORS[room]}) imports {target} (floor {FLOORS[target_room]})")
    assert upward == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    assert find_cycle(graph) is None


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The cycle finder, the import reader and the room rules do catch what they are meant to catch."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    annotations_only = tmp_path / "a.py"
    annotations_only.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    assert imports_of("pkg.a", annotations_only, {"pkg.a", "pkg.b"}) == {"pkg.b"}
    assert room_of("exporters.adapters.ort_internals") == "exporters.adapters.ort_internals"
    assert room_of("probes.compare.html") == "probes.compare"
    assert FLOORS[room_of("exporters.registry")] < FLOORS[room_of("probes.core.functions")]
