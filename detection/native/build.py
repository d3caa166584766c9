"""Build and load the C kernels (``kernels.c``) once per host, and switch them on or off.

What the kernels are for, and what every caller may rely on, is :mod:`detection.native`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

__all__ = [
    "NativeUnavailable",
    "available",
    "is_enabled",
    "library",
    "set_enabled",
    "unavailable_reason",
]

_log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_TUNE = ("-march=native", "-mprefer-vector-width=512")


class NativeUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here (the reason is the message)."""


class _Loader:
    """Builds and loads the library once per process, under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self.enabled = os.environ.get("SDCGUARD_NATIVE", "1").strip().lower() not in (
            "0",
            "false",
            "no",
            "off",
        )

    def get(self) -> ctypes.CDLL | None:
        if not self.enabled:
            return None
        if self.lib is not None or self.error is not None:
            return self.lib
        with self.lock:
            if self.lib is None and self.error is None:
                try:
                    self.lib = _declare(ctypes.CDLL(str(_build())))
                except (NativeUnavailable, OSError) as err:
                    self.error = str(err)
                    _log.warning(
                        "sdcguard native CPU kernels unavailable, the torch ops run instead: %s",
                        err,
                    )
        return self.lib


_LOADER = _Loader()


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _cache_dirs() -> list[Path]:
    """Where the library may go, in order: ``$SDCGUARD_CACHE_DIR`` (or ``~/.cache/sdcguard``),
    then the temporary directory (a read-only home, as in a locked-down container)."""
    root = os.environ.get("SDCGUARD_CACHE_DIR")
    first = Path(root) if root else Path.home() / ".cache" / "sdcguard"
    fallback = Path(tempfile.gettempdir()) / f"sdcguard-{os.getuid()}"
    return [first / "native", fallback / "native"]


def _scratch(targets: list[Path]) -> tuple[Path, str]:
    """The first of ``targets`` whose directory takes a new file, and a scratch file in it."""
    errors = []
    for target in targets:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        except OSError as err:
            errors.append(f"{target.parent}: {err}")
            continue
        os.close(fd)
        return target, scratch
    raise NativeUnavailable("no writable cache: " + "; ".join(errors))


def _build() -> Path:
    """The compiled library's path, compiling it when this source, compiler and CPU have none."""
    source = _SOURCE.read_bytes()
    cc = _compiler()
    for tune in (_TUNE, ()):
        key = hashlib.sha256(
            b"\0".join([source, " ".join(cc + list(_FLAGS + tune)).encode(), _cpu_flags().encode()])
        ).hexdigest()[:20]
        targets = [d / f"kernels-{key}.so" for d in _cache_dirs()]
        for built in targets:
            if built.exists():
                return built
        target, scratch = _scratch(targets)
        command = [*cc, *_FLAGS, *tune, str(_SOURCE), "-o", scratch, "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            Path(scratch).unlink(missing_ok=True)
            raise NativeUnavailable(f"{shlex.join(command)}: {err}") from err
        if done.returncode == 0:
            os.replace(scratch, target)  # atomic: a rank racing this one loads either copy
            return target
        Path(scratch).unlink(missing_ok=True)
        if tune:
            continue  # a compiler without -march=native: build the portable way
        raise NativeUnavailable(f"{shlex.join(command)} failed: {done.stderr.strip()[-500:]}")
    raise AssertionError("unreachable")  # pragma: no cover


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.sdc_stats_f32.argtypes = [p, i64, i64, i32, p]
    lib.sdc_stats_f32.restype = None
    lib.sdc_nonfinite.argtypes = [i64, p, p, p]
    lib.sdc_nonfinite.restype = i32
    lib.sdc_fingerprint.argtypes = [i64, p, p, p, p, p]
    lib.sdc_fingerprint.restype = i32
    f = ctypes.c_float
    lib.sdc_linear_forward_f32.argtypes = [p, p, p, i64, i64, i64, f, f, f, p]
    lib.sdc_linear_forward_f32.restype = None
    lib.sdc_row_sums_f32.argtypes = [p, i64, i64, p, p]
    lib.sdc_row_sums_f32.restype = None
    lib.sdc_col_sums_f32.argtypes = [p, i64, i64, p, p, p]
    lib.sdc_col_sums_f32.restype = None
    lib.sdc_norm_grad_f32.argtypes = [p, p, i64, i64, p]
    lib.sdc_norm_grad_f32.restype = None
    lib.sdc_carry_join_f32.argtypes = [p, i64, i64, p, i64, i64, p]
    lib.sdc_carry_join_f32.restype = None
    lib.sdc_carry_table_f32.argtypes = [p, i64, i64, p]
    lib.sdc_carry_table_f32.restype = i32
    return lib


def available() -> bool:
    """Whether the kernels run in this process (built, loaded and not switched off)."""
    return _LOADER.get() is not None


def set_enabled(enabled: bool) -> None:
    """Switch the kernels on or off for this process (``SDCGUARD_NATIVE`` sets the default).
    Every rank must do the same: the guard refuses to start when ranks disagree."""
    _LOADER.enabled = enabled


def is_enabled() -> bool:
    """Whether the kernels are switched on (they may still be unavailable: :func:`available`)."""
    return _LOADER.enabled


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, or ``None``."""
    if not _LOADER.enabled:
        return "switched off (SDCGUARD_NATIVE=0 or set_enabled(False))"
    _LOADER.get()
    return _LOADER.error


def library() -> ctypes.CDLL:
    """The loaded library: once loaded it stays usable for the lists built with it, even after
    :func:`set_enabled` switched the kernels off for new callers."""
    lib = _LOADER.lib or _LOADER.get()
    if lib is None:
        raise NativeUnavailable(unavailable_reason() or "unavailable")
    return lib
