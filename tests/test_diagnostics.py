"""Diagnostics use ``logging`` and ``warnings``: no library module writes to stderr; only the command line does."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import probes

ROOT = Path(probes.__file__).resolve().parent
COMMAND_LINE = {ROOT / "cli", ROOT / "demo.py", ROOT / "__main__.py"}


def _writes_to_stderr(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in {"write", "writelines"}:
        return ast.unparse(func.value) in {"sys.stderr", "sys.__stderr__"}
    if isinstance(func, ast.Name) and func.id == "print":
        return any(keyword.arg == "file" and "stderr" in ast.unparse(keyword.value) for keyword in node.keywords)
    return False


def _library_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        if not any(path == place or place in path.parents for place in COMMAND_LINE):
            files.append(path)
    return files


def test_no_library_module_writes_to_stderr():
    offenders = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _writes_to_stderr(node):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not offenders, f"use logging.getLogger(__name__) or warnings.warn instead of stderr: {offenders}"


def test_the_scan_finds_a_write_to_stderr():
    assert _writes_to_stderr(ast.parse("print('x', file=sys.stderr)").body[0].value)
    assert _writes_to_stderr(ast.parse("sys.stderr.write('x')").body[0].value)
    assert not _writes_to_stderr(ast.parse("print('x')").body[0].value)


def test_the_probes_logger_is_silent_until_configured():
    handlers = logging.getLogger("probes").handlers
    assert any(isinstance(handler, logging.NullHandler) for handler in handlers)


def test_the_command_line_shows_the_library_diagnostics(tmp_path, capsys):
    from probes.cli.common import run_command, command_parser

    def body(args):
        logging.getLogger("probes.dump.writer").warning("a diagnostic of the library")
        logging.getLogger("probes.dump.writer").info("detail for a configured logger only")
        return 0

    assert run_command("show", command_parser("show", "test", examples=[]), [], body) == 0
    assert capsys.readouterr().err == "probes show: warning: a diagnostic of the library\n"
    logging.getLogger("probes.dump.writer").warning("outside a command")
    assert capsys.readouterr().err == ""
