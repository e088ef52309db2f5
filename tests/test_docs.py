"""Every ```python block of README.md and docs/*.md runs.

Blocks share a prepared namespace (``model``, ``tokens``, ``subscriber`` and the dumps ``eager_out``,
``eager_out2``, ``ort_out`` in the working directory) so that fragments run as written. A block
preceded by ``<!-- docs-test: skip (reason) -->`` is not run; ``<!-- docs-test: ort -->`` runs only
where ORTModule is available.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from probes import StatisticsSubscriber, SubscriberManager
from probes.models import TinyTransformer, TransformerConfig, make_batch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- docs-test: (?P<mark>[^>]*?) -->\s*\n)?```python\n(?P<code>.*?)```", re.S)
CONFIG = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, d_ff=32, seq_len=8)


def page_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, mark, code) of every python block of a page, in order."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start("code")) + 1, m["mark"] or "", m["code"]) for m in BLOCK.finditer(text)]


def ort_available() -> bool:
    try:
        from onnxruntime.training.ortmodule import ORTModule  # noqa: F401
    except Exception:
        return False
    return True


def write_dump(path: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = TinyTransformer(CONFIG)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(path)]):
        batch = make_batch(CONFIG, batch_size=2)
        model(batch["tokens"], labels=batch["labels"]).backward()


@pytest.mark.parametrize("page", [p for p in PAGES if page_blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_code_runs(page, tmp_path, monkeypatch):
    """The blocks of one page run in order, in one namespace and one working directory."""
    monkeypatch.chdir(tmp_path)
    # A page runs as a fresh program would: no torch.compile state (e.g. shapes dynamo has already marked
    # dynamic) left by earlier tests that compiled the same model code.
    torch._dynamo.reset()
    for name in ("eager_out", "eager_out2", "ort_out"):
        write_dump(name)
    torch.manual_seed(0)
    module = types.ModuleType("docs_example")  # a real module: dataclasses and ORT look classes up there
    module.__dict__.update(
        model=TinyTransformer(CONFIG),
        tokens=make_batch(CONFIG, batch_size=2)["tokens"],
        subscriber=StatisticsSubscriber(tmp_path / "subscriber_out"),
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    ran = 0
    try:
        for line, mark, code in page_blocks(page):
            if mark.startswith("skip") or (mark.startswith("ort") and not ort_available()):
                continue
            exec(compile("\n" * (line - 1) + code, str(page), "exec"), module.__dict__)
            ran += 1
    finally:
        SubscriberManager.unsubscribe()
    if ran == 0:
        pytest.skip(f"every block of {page.name} is marked skip or needs ORTModule")
