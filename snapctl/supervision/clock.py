"""Process start times that stay put when the wall clock steps.

The kernel counts a process's start in clock ticks since boot (``/proc/PID/stat``, field 22).
psutil turns that into a wall-clock time by adding ``btime`` from ``/proc/stat``: the wall clock
less the time since boot, read anew by each process. After a clock step (``date -s``, a VM
resumed, NTP stepping) every start time read from then on moves by the step, and a record
written before it names a process that seems gone: the pool would drop its parked copies and
``gc`` would take supervised activations for orphans.

snapctl adds one ``btime`` per boot instead: the first any snapctl process read since boot,
kept in ``/run/snapctl/boot-clock.json`` with the boot's id (a file left from another boot, on
a ``/run`` that is not a tmpfs, is replaced). Start times still read as seconds since the
epoch, equal to psutil's until the clock steps, and differ from one boot to the next as the
boots do, so a PID that the next boot gives out again is never taken for the recorded process.
Where that file cannot be written (not root), a process keeps the first ``btime`` it read.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path

from pydantic import ValidationError

from snapctl.models import StrictModel

BOOT_CLOCK = Path("/run/snapctl/boot-clock.json")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BootClock(StrictModel):
    """``boot-clock.json``: the ``btime`` every snapctl process adds to start ticks this boot."""

    boot_id: str
    btime: float


def read_btime() -> float:
    """``/proc/stat``'s btime: whole seconds of the wall clock less the time since boot."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError("/proc/stat has no btime line")


def read_stat(pid: int) -> tuple[str, int]:
    """``pid``'s state letter (``Z`` a zombie, ``X`` dead, ...) and its start in clock ticks
    since boot, from one read of ``/proc/PID/stat`` (FileNotFoundError or ProcessLookupError
    when there is no such process)."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    # Fields after the command name, which may itself hold spaces and parentheses.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


_lock = threading.Lock()
_btime: float | None = None


def boot_btime() -> float:
    """This boot's ``btime`` as snapctl fixed it (see the module's docstring), read once per
    process."""
    global _btime
    with _lock:
        if _btime is None:
            _btime = _fixed_btime(BOOT_CLOCK)
        return _btime


def forget_btime() -> None:
    """Read the fixed ``btime`` again at the next start time, as a new process would."""
    global _btime
    with _lock:
        _btime = None


def _recorded_btime(path: Path, boot_id: str) -> float | None:
    """The ``btime`` fixed in ``path`` for this boot; None when there is none (no file, another
    boot's, unreadable)."""
    with contextlib.suppress(OSError, ValidationError):
        recorded = BootClock.model_validate_json(path.read_bytes())
        if recorded.boot_id == boot_id:
            return recorded.btime
    return None


def _fixed_btime(path: Path) -> float:
    boot_id = BOOT_ID.read_text().strip()
    recorded = _recorded_btime(path, boot_id)
    if recorded is not None:
        return recorded
    mine = BootClock(boot_id=boot_id, btime=read_btime())
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".boot-clock.", delete=False) as f:
            f.write(mine.model_dump_json().encode())
        try:
            # The first writer this boot wins: link() never replaces a file another wrote.
            os.link(f.name, path)
        except FileExistsError:
            recorded = _recorded_btime(path, boot_id)
            if recorded is not None:
                return recorded
            os.replace(f.name, path)  # another boot's (a /run kept across boots), or unreadable
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.name)
    except (OSError, ValidationError):
        pass  # not writable here: this process's own first reading
    return mine.btime


def since_boot(ticks: int) -> float:
    """Clock ticks since boot as seconds since the epoch, as of this boot's fixed ``btime``."""
    return boot_btime() + ticks / CLOCK_TICKS


def start_time(pid: int) -> float:
    """When ``pid`` started, in seconds since the epoch as of this boot's fixed ``btime``."""
    return since_boot(read_stat(pid)[1])
