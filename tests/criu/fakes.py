"""A shell script standing in for CRIU (tests of how snapctl drives it, not of CRIU)."""

from __future__ import annotations

from pathlib import Path

from snapctl.criu import CriuBinary


def install_fake_criu(directory: Path, script: str) -> CriuBinary:
    """Write ``script`` as an executable ``criu`` in ``directory`` and return it as the CRIU
    to use (reported as 4.2.1, chosen by option)."""
    path = directory / "criu"
    path.write_text(script)
    path.chmod(0o755)
    return CriuBinary(path=path, version="4.2.1", source="option")
