"""Find a usable CRIU: explicit option, ``SNAPCTL_CRIU``, the private prefix, then PATH.

A CRIU unpacked by ``scripts/install-criu`` is a shell wrapper that runs the real binary through
its own unpacked loader. The installer also writes :data:`LAUNCH_FILE` beside ``bin/``, the
same command as data, so snapctl runs the loader directly: the wrapper's shell, ``readlink`` and
two ``dirname`` cost time per CRIU process (docs/criu.md), and a lazy copy waits for two of them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from snapctl.errors import ExitStatus, SnapctlError
from snapctl.models import StrictModel

MINIMUM_VERSION = (4, 2)
DEFAULT_PREFIX = Path("/opt/snapctl/criu")
INSTALL_HINT = "run scripts/install-criu as root to install CRIU >= 4.2 into /opt/snapctl/criu"
LAUNCH_FILE = "snapctl-launch.json"


class CriuNotFound(SnapctlError):
    """No usable CRIU binary was found (or the one named is unusable)."""

    exit_status = ExitStatus.UNAVAILABLE


class PrefixLaunch(StrictModel):
    """``snapctl-launch.json`` of an unpacked CRIU prefix: how its wrapper runs CRIU, with
    paths relative to the prefix."""

    loader: str
    library_path: list[str]
    program: str

    def command(self, prefix: Path) -> tuple[str, ...]:
        libraries = ":".join(str(prefix / part) for part in self.library_path)
        return (str(prefix / self.loader), "--library-path", libraries, str(prefix / self.program))


@dataclass(frozen=True)
class CriuBinary:
    """A CRIU executable and the version it reports."""

    path: Path
    version: str
    source: str  # "option", "env", "prefix" or "path": where it was found
    # What runs it when not ``path`` itself (the loader of an unpacked prefix; see above).
    command: tuple[str, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        """The argv prefix that runs this CRIU: ``argv + ("restore", ...)``."""
        return self.command or (str(self.path),)

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", self.version)[:3])

    def check(self, timeout_s: float = 60.0) -> tuple[bool, str]:
        """Run ``criu check``; return (passed, combined output)."""
        proc = subprocess.run(
            [*self.argv, "check"],
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
        binary = CriuBinary(path=path, version=version, source=source, command=direct_command(path))
        if binary.version_tuple[:2] >= MINIMUM_VERSION:
            return binary
        if source in ("option", "env"):
            raise CriuNotFound(f"CRIU {version} at {path} is too old (need >= 4.2)", path=str(path))
        rejected.append(f"{path} is {version}")
    detail = f" ({'; '.join(rejected)})" if rejected else ""
    raise CriuNotFound(f"no CRIU >= 4.2 found{detail}; {INSTALL_HINT}")


def direct_command(wrapper: Path) -> tuple[str, ...]:
    """The loader command of the unpacked prefix that ``wrapper`` (``PREFIX/bin/criu``) belongs
    to, or ``()`` to run ``wrapper`` itself (any other CRIU, or a prefix without a usable
    launch file: the wrapper always works, it is only slower)."""
    prefix = wrapper.resolve().parent.parent
    try:
        launch = PrefixLaunch.model_validate_json((prefix / LAUNCH_FILE).read_bytes())
    except (OSError, ValidationError):
        return ()
    command = launch.command(prefix)
    if not all(os.access(part, os.X_OK) for part in (command[0], command[-1])):
        return ()
    return command
