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


def blocks():
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            marks = [pytest.mark.ort] if (match["mark"] or "").startswith("ort") else []
            if (match["mark"] or "").startswith("skip"):
                marks.append(pytest.mark.skip(reason=f"marked in the page: {match['mark']}"))
            yield pytest.param(page, match["code"], id=f"{page.relative_to(ROOT)}:{line}", marks=marks)


def write_dump(path: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = TinyTransformer(CONFIG)
    with SubscriberManager().subscribe(model, [StatisticsSubscriber(path)]):
        batch = make_batch(CONFIG, batch_size=2)
        model(batch["tokens"], labels=batch["labels"]).backward()


@pytest.mark.parametrize("page, code", list(blocks()))
def test_docs_code_runs(page, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
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
    try:
        exec(compile(code, str(page), "exec"), module.__dict__)
    finally:
        SubscriberManager.unsubscribe()
