"""What the machine itself does, without snapctl: its description, how fast it reads an
image's files from page cache, and the commands whose start-up time is measured."""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import sys
import time
from pathlib import Path

from bench.results import Machine

READ_CHUNK = 8 << 20
MIB = 1 << 20


def machine(criu_version: str) -> Machine:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return Machine(
        cpu=cpu,
        cores=os.cpu_count() or 0,
        memory_gib=round(mem_kib / (1 << 20), 1),
        kernel=platform.release(),
        python=platform.python_version(),
        criu=criu_version,
        load_average=os.getloadavg(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


def image_files(image: Path) -> list[Path]:
    return sorted(p for p in (image / "criu").rglob("*") if p.is_file())


def read_rates(image: Path) -> tuple[float, float]:
    """MB/s reading the image's CRIU files from page cache into one reused buffer, and into
    freshly mapped anonymous memory (what a restore must do: every page is new to the tree)."""
    files = image_files(image)
    total = sum(p.stat().st_size for p in files)
    buffer = bytearray(READ_CHUNK)
    started = time.monotonic()
    for path in files:
        with path.open("rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    cached = total / MIB / (time.monotonic() - started)
    started = time.monotonic()
    for path in files:
        size = path.stat().st_size
        if not size:
            continue
        with path.open("rb", buffering=0) as handle, mmap.mmap(-1, size) as fresh:
            view = memoryview(fresh)
            offset = 0
            while offset < size and (got := handle.readinto(view[offset : offset + READ_CHUNK])):
                offset += got
            view.release()
    fresh_rate = total / MIB / (time.monotonic() - started)
    return cached, fresh_rate


def compile_bytecode() -> None:
    """Write the checkout's bytecode before anything is timed, as installing a wheel does:
    where PYTHONDONTWRITEBYTECODE is set (this host sets it), every CLI process would
    otherwise compile each module it imports from source again."""
    import compileall

    from snapctl.activation.launch import repo_root

    for package in ("snapctl", "fixtures"):
        if not compileall.compile_dir(repo_root() / package, quiet=1):
            raise RuntimeError(f"python -m compileall {package} failed")


def cli_commands() -> dict[str, list[str]]:
    """The CLI as a user runs it (the console script beside this Python, else ``-m``)."""
    script = Path(sys.executable).parent / "snapctl"
    snapctl = [str(script)] if script.exists() else [sys.executable, "-m", "snapctl"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "snapctl --help": [*snapctl, "--help"],
        "snapctl copy --help": [*snapctl, "copy", "--help"],
    }
