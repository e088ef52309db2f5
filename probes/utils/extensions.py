"""Building a C++ extension of probes: once per name, into torch's extension cache, safe across processes.

    module = build_inline("probes_stats_v4_torch2_4_1_avx2", source_text, ["-O3"])

``torch.utils.cpp_extension.load_inline`` compiles ``source`` unless a build under ``name`` is cached (the
torch_extensions cache is shared by all virtual environments: put the torch version and whatever else the
binary depends on into ``name``).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import warnings
from types import ModuleType
from typing import Callable, Generic, TypeVar

from exporters.adapters import torch_internals

Built = TypeVar("Built")

__all__ = ["BuiltOnce", "build_error_lines", "build_inline"]


def build_inline(name: str, source: str, extra_cflags: list[str]) -> ModuleType:
    """The extension module ``name`` built from the C++ ``source`` (raises the compiler's or loader's error)."""
    # CUDA builds of torch print "No CUDA runtime is found" on this import; we build no CUDA code.
    with contextlib.redirect_stderr(io.StringIO()):
        from torch.utils import cpp_extension

    def build() -> ModuleType:
        return cpp_extension.load_inline(name=name, cpp_sources=[source], extra_cflags=extra_cflags, verbose=False)

    try:
        import fcntl
    except ImportError:  # no flock (Windows)
        return build()
    build_dir = torch_internals.extension_build_directory(name)
    if build_dir is None:
        return build()
    os.makedirs(build_dir, exist_ok=True)
    # torch's own build lock is a file that stays behind when a building process is killed, and
    # then blocks every later process forever. An flock dies with its process: whoever holds it
    # knows that a leftover torch lock is stale.
    with open(os.path.join(build_dir, "probes_build.flock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            os.remove(os.path.join(build_dir, "lock"))
        except FileNotFoundError:
            pass
        return build()


def build_error_lines(error: BaseException, count: int = 6) -> str:
    """The lines of a failed build's error worth showing: its first line and the compiler's errors."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return "\n".join((lines[:1] + errors[: count - 1]) if errors else lines[:count])


class BuiltOnce(Generic[Built]):
    """What an extension's build gives (``build()``), made at most once per process: a loaded extension cannot be
    unloaded and a build takes seconds. Its failure raises where the extension was required, else warns once.

        kernel = BuiltOnce(build, required="the kernel was requested but could not be built",
                           fallback="building the kernel failed; using the slower path")
        kernel.load(required=False)   # the built object, or None (warned once)
    """

    def __init__(self, build: Callable[[], Built], *, required: str, fallback: str) -> None:
        self._build = build
        self._required, self._fallback = required, fallback
        self._lock = threading.Lock()
        self._built: Built | None = None
        self._error: BaseException | None = None
        self._warned = False

    def load(self, *, required: bool, stacklevel: int = 3) -> Built | None:
        if self._built is not None:
            return self._built
        with self._lock:
            if self._built is None and self._error is None:
                try:
                    self._built = self._build()
                except Exception as error:  # compiler, ninja or loader failure, or a check of what was built
                    self._error = error
            if self._built is not None:
                return self._built
            if required:
                raise RuntimeError(f"{self._required}:\n{build_error_lines(self._error)}") from self._error
            if not self._warned:
                self._warned = True
                warnings.warn(f"{self._fallback}:\n{build_error_lines(self._error)}", RuntimeWarning,
                              stacklevel=stacklevel)
            return None
