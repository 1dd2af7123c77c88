"""An activation's resource limits and their podman spellings: ``--memory SIZE`` (bytes, or a
number with a ``b``, ``k``, ``m`` or ``g`` suffix, powers of 1024) and ``--cpus N`` (a float:
N CPUs' worth of time every period)."""

from __future__ import annotations

import math
import re

from pydantic import Field

from snapctl.models import StrictModel

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# The least memory limit accepted (podman's least is 6 MiB; a server needs far more anyway).
MIN_MEMORY_BYTES = 6 << 20
# The CFS period every --cpus quota is a share of, in microseconds (podman's and the kernel's).
CPU_PERIOD_US = 100_000


def parse_size(text: str, least: int = MIN_MEMORY_BYTES) -> int:
    """``512m``, ``4g``, ``1.5g``, ``1048576``: bytes, at least ``least`` (the least memory
    limit unless told). Raises ValueError."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with b, k, m or g)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < least:
        raise ValueError(f"{text!r} is less than the least size here, {format_size(least)}")
    return value


def parse_cpus(text: str) -> float:
    """``2``, ``0.5``: CPUs. Raises ValueError."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of CPUs") from None
    if not math.isfinite(value) or value < 0.01:
        raise ValueError(f"{text!r} CPUs: at least 0.01")
    return value


def format_size(nbytes: int) -> str:
    """The shortest exact podman spelling: ``512m``, ``4g``, or bytes."""
    for suffix, unit in (("g", 1 << 30), ("m", 1 << 20), ("k", 1 << 10)):
        if nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


class Limits(StrictModel):
    """What an activation's cgroup allows: None is no limit."""

    memory_bytes: int | None = Field(default=None, ge=MIN_MEMORY_BYTES)
    cpus: float | None = Field(default=None, ge=0.01)

    @property
    def any(self) -> bool:
        return self.memory_bytes is not None or self.cpus is not None

    def cpu_quota_us(self) -> int | None:
        """The CFS quota per :data:`CPU_PERIOD_US` that ``cpus`` means."""
        return None if self.cpus is None else max(1000, round(self.cpus * CPU_PERIOD_US))

    def describe(self) -> str:
        """The options that set them: ``--memory 512m --cpus 1.5`` (empty: none)."""
        parts = []
        if self.memory_bytes is not None:
            parts.append(f"--memory {format_size(self.memory_bytes)}")
        if self.cpus is not None:
            parts.append(f"--cpus {self.cpus:g}")
        return " ".join(parts)
