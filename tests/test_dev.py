"""./dev set-up on an empty environment cache: nothing a library prints may leak into a path or a command's output.

Real installs take minutes, so the lane's interpreter here is a stand-in that prints log lines to
stdout on every call, as deepspeed does when imported (it also fakes the venv, pip and the ORT
extension build). The first ``./dev run`` on a scratch PROBES_ENV_ROOT must create the lane and run
the command in it, with the command's stdout alone on stdout.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOISE = "[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU."

FAKE_PYTHON = f"""#!/usr/bin/env bash
# Stand-in interpreter: logs to stdout like deepspeed's import, then fakes what ./dev asks of it.
echo '{NOISE}'
here="$(cd "$(dirname "$0")" && pwd)"
case "$1 $2" in
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-m pip") ;;
  "-m onnxruntime.training.ortmodule.torch_cpp_extensions.install") touch "$here/../extensions-built" ;;
  "- ") cat >/dev/null; [ -f "$here/../extensions-built" ] || exit 1 ;;
  *) ;;
esac
exit 0
"""


def _fake_python(directory: Path) -> Path:
    path = directory / "python-that-logs-to-stdout"
    path.write_text(FAKE_PYTHON)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _dev(*args: str, env_root: Path, python: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROBES_ENV_ROOT": str(env_root), "PROBES_PYTHON": str(python)}
    return subprocess.run([str(ROOT / "dev"), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("lane", ["ort", "modern"], ids=["ort-lane", "modern-lane"])  # not "ort": that id is the ORTModule marker
def test_first_run_on_an_empty_cache_passes_no_library_output_into_paths(tmp_path, lane):
    env_root = tmp_path / "envs"
    python = _fake_python(tmp_path)
    for attempt in ("first", "cached"):
        result = _dev("run", "--lane", lane, "printenv", "VIRTUAL_ENV", env_root=env_root, python=python)
        assert result.returncode == 0, f"{attempt} run failed: {result.stderr}"
        lines = result.stdout.splitlines()
        assert len(lines) == 1 and NOISE not in result.stdout, f"{attempt} run: stdout is not just the command's: {result.stdout!r}"
        lane_dir = Path(lines[0])
        assert lane_dir.parent == env_root and lane_dir.name.startswith(f"{lane}-")
        assert (lane_dir / ".ready").is_file() and (lane_dir / "bin" / "python").is_file()
    if lane == "ort":
        assert (lane_dir / "extensions-built").is_file(), "the ORT extension build step did not run"
    assert "creating the" in _dev("setup", lane, env_root=tmp_path / "other", python=python).stderr


def test_unknown_lane_is_one_line_and_exit_code_2(tmp_path):
    result = _dev("run", "--lane", "nightly", "true", env_root=tmp_path / "envs", python=_fake_python(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["[dev] error: unknown lane 'nightly' (expected ort or modern)"]
