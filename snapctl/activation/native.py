"""The native (device) step around a dump and after a restore.

``lock``/``checkpoint`` run before CRIU dumps; ``restore``/``unlock`` after the dump (donor)
or after the restore (copy), each per process with a timeout. ``none`` does nothing (no GPU);
``cuda-checkpoint`` calls NVIDIA's tool for every process that holds CUDA.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import psutil

from snapctl.errors import SnapctlError


class NativeStepError(SnapctlError):
    """The device step failed for a process."""


class NativeStep(Protocol):
    name: str

    def before_dump(self, pids: Iterable[int], timeout_s: float) -> None: ...

    def after_dump(self, pids: Iterable[int], timeout_s: float) -> None: ...

    def after_restore(self, pids: Iterable[int], timeout_s: float) -> None: ...


class NoNativeStep:
    """Nothing to do on a machine without a GPU."""

    name = "none"

    def before_dump(self, pids: Iterable[int], timeout_s: float) -> None:
        pass

    def after_dump(self, pids: Iterable[int], timeout_s: float) -> None:
        pass

    def after_restore(self, pids: Iterable[int], timeout_s: float) -> None:
        pass


def holds_cuda(pid: int) -> bool:
    """True when the process has the CUDA driver library mapped."""
    try:
        return "libcuda.so" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


class CudaCheckpoint:
    """NVIDIA's ``cuda-checkpoint --action ACTION --pid PID`` for each CUDA process."""

    name = "cuda-checkpoint"

    def __init__(self, binary: str | None = None) -> None:
        found = (
            binary or os.environ.get("SNAPCTL_CUDA_CHECKPOINT") or shutil.which("cuda-checkpoint")
        )
        if not found:
            raise NativeStepError("cuda-checkpoint not found (set SNAPCTL_CUDA_CHECKPOINT)")
        self.binary = found

    def _each(self, action: str, pids: Iterable[int], timeout_s: float) -> None:
        for pid in pids:
            if not holds_cuda(pid):
                continue
            argv = [self.binary, "--action", action, "--pid", str(pid)]
            try:
                proc = subprocess.run(
                    argv, capture_output=True, text=True, timeout=timeout_s, check=False
                )
            except subprocess.TimeoutExpired as error:
                raise NativeStepError(
                    f"cuda-checkpoint {action} timed out after {timeout_s:g} s", pid=pid
                ) from error
            if proc.returncode != 0:
                raise NativeStepError(
                    f"cuda-checkpoint {action} failed ({proc.returncode}): {proc.stderr.strip()}",
                    pid=pid,
                )

    def before_dump(self, pids: Iterable[int], timeout_s: float) -> None:
        pids = list(pids)
        self._each("lock", pids, timeout_s)
        self._each("checkpoint", pids, timeout_s)

    def after_dump(self, pids: Iterable[int], timeout_s: float) -> None:
        pids = list(pids)
        self._each("restore", pids, timeout_s)
        self._each("unlock", pids, timeout_s)

    after_restore = after_dump


@contextlib.contextmanager
def timed(native: NativeStep, timings: dict[str, float], phase: str) -> Iterator[None]:
    """Record how long a native step's call took as ``timings[phase]`` (not for ``none``)."""
    started = time.monotonic()
    yield
    if native.name != NoNativeStep.name:
        timings[phase] = time.monotonic() - started


def native_step(name: str) -> NativeStep:
    if name == "none":
        return NoNativeStep()
    if name == "cuda-checkpoint":
        return CudaCheckpoint()
    raise NativeStepError(f"unknown native step {name!r} (none, cuda-checkpoint)")


def tree_pids_when_read(root_pid: int) -> Iterator[int]:
    """:func:`tree_pids`, scanned only once iterated: the ``none`` step never reads its PIDs,
    and the scan walks every process of the host (ms on a busy one, on a copy's critical
    path)."""
    yield from tree_pids(root_pid)


def tree_pids(root_pid: int) -> list[int]:
    """The root and all its descendants, parents first."""
    try:
        root = psutil.Process(root_pid)
        return [root_pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess as error:
        raise NativeStepError("the tree exited before its native step", pid=root_pid) from error
