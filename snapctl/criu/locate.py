"""Find a usable CRIU: explicit option, ``SNAPCTL_CRIU``, the private prefix, then PATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from snapctl.errors import SnapctlError

MINIMUM_VERSION = (4, 2)
DEFAULT_PREFIX = Path("/opt/snapctl/criu")
INSTALL_HINT = "run scripts/install-criu as root to install CRIU >= 4.2 into /opt/snapctl/criu"


class CriuNotFound(SnapctlError):
    """No usable CRIU binary was found (or the one named is unusable)."""


@dataclass(frozen=True)
class CriuBinary:
    """A CRIU executable and the version it reports."""

    path: Path
    version: str
    source: str  # "option", "env", "prefix" or "path": where it was found

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", self.version)[:3])

    def check(self, timeout_s: float = 60.0) -> tuple[bool, str]:
        """Run ``criu check``; return (passed, combined output)."""
        proc = subprocess.run(
            [str(self.path), "check"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def criu_version(path: Path, timeout_s: float = 10.0) -> str:
    """Return the version string printed by ``criu --version`` (e.g. ``4.2.1``)."""
    try:
        proc = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except OSError as error:
        raise CriuNotFound(f"cannot run {path}: {error.strerror}", path=str(path)) from error
    except subprocess.TimeoutExpired as error:
        message = f"{path} --version did not answer within {timeout_s:g} s"
        raise CriuNotFound(message, path=str(path)) from error
    match = re.search(r"^Version:\s*(\S+)", proc.stdout, re.MULTILINE)
    if proc.returncode != 0 or match is None:
        raise CriuNotFound(f"{path} --version failed: {proc.stderr.strip()}", path=str(path))
    return match.group(1)


def _candidates(explicit: str | os.PathLike[str] | None) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    if explicit:
        found.append(("option", Path(explicit)))
    if env := os.environ.get("SNAPCTL_CRIU"):
        found.append(("env", Path(env)))
    prefix = Path(os.environ.get("SNAPCTL_CRIU_PREFIX", DEFAULT_PREFIX))
    found.append(("prefix", prefix / "bin" / "criu"))
    if on_path := shutil.which("criu"):
        found.append(("path", Path(on_path)))
    return found


def find_criu(explicit: str | os.PathLike[str] | None = None) -> CriuBinary:
    """Return the first usable CRIU (>= 4.2); an explicit choice that is unusable is an error."""
    rejected: list[str] = []
    for source, path in _candidates(explicit):
        if not path.exists():
            if source in ("option", "env"):
                raise CriuNotFound(f"CRIU given by {source} does not exist: {path}", path=str(path))
            continue
        version = criu_version(path)
        binary = CriuBinary(path=path, version=version, source=source)
        if binary.version_tuple[:2] >= MINIMUM_VERSION:
            return binary
        if source in ("option", "env"):
            raise CriuNotFound(f"CRIU {version} at {path} is too old (need >= 4.2)", path=str(path))
        rejected.append(f"{path} is {version}")
    detail = f" ({'; '.join(rejected)})" if rejected else ""
    raise CriuNotFound(f"no CRIU >= 4.2 found{detail}; {INSTALL_HINT}")
