"""The HTML comparison report: self-contained with its plots, reduced visibly for big dumps, and rendered
in headless Chromium with its plots visible (that test skips without chromium)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from probes.compare.options import MOMENTS

from probes.compare import compare_dumps
from probes.compare.html import BASE_COLOR, MARK_COLOR, OTHER_COLOR, HtmlConfig, render_html, write_html
from probes.dump import load_dump
from test_compare import ROOT, STEPS, base_run, run_cli, synthetic_records, train_run, write_dump  # noqa: F401 (fixture)
from test_compare_reading import imported_names

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)")


class SvgCounter(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.classes: dict[str, int] = {}
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for key, value in attrs:
            if key == "class":
                for name in (value or "").split():
                    self.classes[name] = self.classes.get(name, 0) + 1
            if key in ("src", "href") or (key == "style" and "url(" in (value or "")):
                self.external.append(f"{tag} {key}={value}")


def test_html_report_is_self_contained_with_plots(base_run, tmp_path, capsys):
    train_run(tmp_path / "other", bug=("blocks.0.mlp.0", 1, "forward"))
    code, out, _ = run_cli(base_run, tmp_path / "other", "--html", tmp_path / "r.html", capsys=capsys)
    assert code == 1 and f"HTML report: {tmp_path / 'r.html'}" in out
    text = (tmp_path / "r.html").read_text()
    counter = SvgCounter()
    counter.feed(text)
    records_per_step = len(load_dump(base_run)) // STEPS
    assert counter.tags.get("script", 0) == 0 and counter.external == []
    assert counter.classes["heatmap"] == 2  # forward and backward
    assert counter.classes["cell"] == records_per_step * STEPS
    assert counter.classes["first-divergence"] == 1
    assert counter.classes["chart"] == 6 * len(MOMENTS)  # six layers x (min, max, mean, std, norm)
    assert counter.classes["divergence-step"] == len(MOMENTS)  # the first divergence's layer marks its step in each chart
    assert "DIVERGED at rank 0, step 1, forward, blocks.0.mlp.0.output.0" in text


def test_html_report_reduces_big_dumps_visibly(tmp_path):
    write_dump(tmp_path / "base", 0, {s: synthetic_records(s, 0) for s in range(5)})
    write_dump(tmp_path / "other", 0, {s: synthetic_records(s, 0, bump={("forward", 0): 1.5} if s == 3 else None)
                                       for s in range(5)})
    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    text = render_html(report, HtmlConfig(max_rows=2, max_columns=2, trajectories=1))
    counter = SvgCounter()
    counter.feed(text)
    assert counter.classes["cell"] == 2 * 2 * 2  # per phase: 2 rows x 2 columns (steps 0-2, 3-4)
    assert text.count("rows with the smallest errors are not shown (limit 2)") == 2
    assert text.count("Each column covers 3 steps") == 2
    assert counter.classes["first-divergence"] == 1 and counter.classes["chart"] == len(MOMENTS)
    assert "rank 0 step 3-4 forward l0.output.0: relative error 0.5" in text


def test_the_html_report_reads_the_result_model_never_the_engine():
    result_model = {"options", "results", "recorddiffs"}
    for module in ("html", "terminal", *result_model):  # what the page reads, and what that reads
        imports = imported_names(ROOT / "probes" / "compare" / f"{module}.py")
        compare_modules = {name.split(".")[2] for name in imports if name.startswith("probes.compare.")}
        assert compare_modules <= result_model | {"terminal"}, f"{module}.py imports {sorted(compare_modules)}"


# --------------------------------------------------------------------------------------------- in a browser


def read_png(path: Path) -> np.ndarray:
    """Decodes an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium's --screenshot writes) to HxWxC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    position, chunks, header = 8, [], None
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        position += 12 + length
    width, height, depth, color_type, _, _, interlace = header
    assert depth == 8 and color_type in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    channels = 3 if color_type == 2 else 4
    stride = width * channels
    raw = zlib.decompress(b"".join(chunks))
    rows: list[list[int]] = []
    previous = [0] * stride
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], raw[start + 1:start + 1 + stride]
        if kind == 0:
            row = list(line)
        elif kind == 2:
            row = [(a + b) & 0xFF for a, b in zip(line, previous)]
        else:  # Sub, Average, Paeth depend on the reconstructed left neighbour: byte by byte
            row = [0] * stride
            for x in range(stride):
                left = row[x - channels] if x >= channels else 0
                up = previous[x]
                if kind == 1:
                    predictor = left
                elif kind == 3:
                    predictor = (left + up) >> 1
                else:
                    up_left = previous[x - channels] if x >= channels else 0
                    p = left + up - up_left
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                    predictor = left if pa <= pb and pa <= pc else (up if pb <= pc else up_left)
                row[x] = (line[x] + predictor) & 0xFF
        rows.append(row)
        previous = row
    image = np.array(rows, dtype=np.uint8)
    return image.reshape(height, width, channels)[:, :, :3]


def pixels_of(image: np.ndarray, color: str, tolerance: int = 10) -> int:
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(image.astype(np.int32) - rgb).max(axis=2) <= tolerance).sum())


@needs_chromium
def test_html_report_renders_in_headless_chromium(tmp_path):
    for name in ("base", "other"):
        bumps = {2: {("forward", 1): 1.5}} if name == "other" else {}
        write_dump(tmp_path / name, 0, {s: synthetic_records(s, 0, bump=bumps.get(s)) for s in range(4)})
    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    page = write_html(report, tmp_path / "report.html")
    screenshot = tmp_path / "shot.png"
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,1600",
               f"--screenshot={screenshot}", page.resolve().as_uri()]
    result = subprocess.run(command, capture_output=True, timeout=120)
    assert result.returncode == 0 and screenshot.exists(), result.stderr.decode(errors="replace")[-2000:]

    image = read_png(screenshot)
    assert image.shape[:2] == (1600, 1000)
    non_white = (image < 245).any(axis=2).mean()
    assert non_white > 0.03, f"the page looks blank ({non_white:.1%} non-white pixels)"
    # Colours that only the SVG plots draw: both runs' swatches and lines, and the first-divergence ring.
    assert pixels_of(image, BASE_COLOR) > 200
    assert pixels_of(image, OTHER_COLOR) > 200
    assert pixels_of(image, MARK_COLOR) > 40
    # The heatmap's palette: a diverged cell is dark red, equal cells light grey.
    assert pixels_of(image, "#b10026", tolerance=30) > 50


def test_the_per_step_table_of_a_long_run_keeps_the_steps_that_matter(tmp_path):
    bumps = {3: {("forward", 0): 1.5}, 6: {("forward", 1): 1 + 1e-6}}  # step 3 diverges, step 6 is the worst of the rest
    write_dump(tmp_path / "base", 0, {s: synthetic_records(s, 0) for s in range(8)})
    write_dump(tmp_path / "other", 0, {s: synthetic_records(s, 0, bump=bumps.get(s)) for s in range(8)})
    report = compare_dumps(tmp_path / "base", tmp_path / "other")
    table = render_html(report, HtmlConfig(max_steps=2)).split("<h2>Per step</h2>")[1].split("</table>")[0]
    shown = [int(cell.split(">")[1].split("<")[0]) for cell in table.split("<tr>")[2:]]
    assert shown == [3, 6]
    assert "6 more steps, all within tolerance and with every record in both runs, are not shown (limit 2)" in \
        render_html(report, HtmlConfig(max_steps=2))
    assert "more steps" not in render_html(report)  # eight steps: all shown by default
