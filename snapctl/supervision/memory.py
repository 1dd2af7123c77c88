"""What process trees hold in memory, and the host's kernel same-page merging (KSM).

A tree's memory is its PSS: a page that several processes map counts once in all of them
together, so the PSS of copies that share pages adds up to what the host really holds. Copies of
an image captured under the ``in-image`` memory policy have their memory marked mergeable (the
launcher does it before the capture, and CRIU restores the mark on every mapping); with ``ksmd``
running, the pages they never write (the weights) become one page in the host's memory.
:func:`enable_ksm` starts ``ksmd`` where it is stopped; :func:`read_ksm` tells what it saves.
KSM only scans memory marked mergeable: copies of ``in-image`` images, and whatever else on the
host asked for it (virtual machines, services started with ``MemoryKSM=``), which it then merges
too.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil

from snapctl.models import StrictModel
from snapctl.supervision.process import ProcessGoneError, descendants, same_start, start_time

KSM_DIR = Path("/sys/kernel/mm/ksm")
# When snapctl starts ksmd: this many pages per wake-up, at this interval, so that copies of a
# model of real size merge in seconds rather than minutes (docs/pool.md has what it costs);
# the kernel's own advisor (``advisor_mode=scan-time``) starts far slower.
KSM_PAGES_PER_WAKE = 5000
KSM_SLEEP_MS = 20


def tree_members(pids: list[tuple[int, float | None]]) -> list[psutil.Process]:
    """These processes (each only while it is the one started at its recorded time) and all
    their descendants, each once."""
    members: dict[int, psutil.Process] = {}
    for pid, recorded in pids:
        try:
            root = psutil.Process(pid)
            if recorded is not None and not same_start(start_time(pid), recorded):
                continue
            tree = [root, *root.children(recursive=True)]
        except (psutil.Error, ProcessGoneError):  # gone meanwhile: psutil saw it, /proc not
            continue
        for member in tree:
            members.setdefault(member.pid, member)
    return list(members.values())


def members_memory(members: list[psutil.Process]) -> int | None:
    """PSS (RSS where PSS is unreadable) of ``members`` together; None if none was readable."""
    total, found = 0, False
    for member in members:
        try:
            info = member.memory_full_info()
            total += int(getattr(info, "pss", info.rss))
            found = True
        except psutil.AccessDenied:
            with contextlib.suppress(psutil.Error):
                total += int(member.memory_info().rss)
                found = True
        except psutil.Error:
            continue
    return total if found else None


def ksm_saved(pids: list[int], proc: Path = Path("/proc")) -> int | None:
    """What KSM saves in the processes ``pids`` together (each one's ``ksm_process_profit``: its
    pages merged with others, less KSM's bookkeeping for them); None where the kernel tells
    none."""
    total, found = 0, False
    for pid in pids:
        try:
            with (proc / str(pid) / "ksm_stat").open(encoding="ascii") as stat:
                fields = dict(line.split(maxsplit=1) for line in stat if " " in line)
            total += int(fields["ksm_process_profit"])
            found = True
        except (OSError, KeyError, ValueError):  # gone, or a kernel before Linux 6.7
            continue
    return total if found else None


class TreeMemory(StrictModel):
    """A tree's PSS and what KSM saves in it (None: unreadable)."""

    pss_bytes: int | None
    ksm_saved_bytes: int | None


def tree_memory(root_pid: int, root_start_time: float | None) -> TreeMemory | None:
    """The PSS of the tree under ``root_pid`` and what KSM saves in it (None: gone, or another
    process now). The tree is listed from its own ``/proc`` entries (``descendants``), not by
    a scan of every process: ``ps`` reads this for every activation."""
    try:
        if root_start_time is not None and not same_start(start_time(root_pid), root_start_time):
            return None
    except ProcessGoneError:
        return None
    pids = descendants(root_pid)
    members = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            members.append(psutil.Process(pid))
    return TreeMemory(pss_bytes=members_memory(members), ksm_saved_bytes=ksm_saved(pids))


class KsmStatus(StrictModel):
    """What ``ksmd`` does now: whether it runs, and the memory it saves."""

    running: bool
    saved_bytes: int  # the kernel's general_profit: pages merged less its own bookkeeping
    pages_sharing: int
    full_scans: int


def read_ksm(ksm_dir: Path = KSM_DIR) -> KsmStatus | None:
    """The host's KSM, or None where the kernel has none."""
    try:
        values = {
            name: int((ksm_dir / name).read_text())
            for name in ("run", "pages_sharing", "full_scans")
        }
    except (OSError, ValueError):
        return None
    try:
        saved = int((ksm_dir / "general_profit").read_text())
    except (OSError, ValueError):  # before Linux 6.7: what merging saved, less nothing
        saved = values["pages_sharing"] * os.sysconf("SC_PAGE_SIZE")
    return KsmStatus(
        running=values["run"] == 1, saved_bytes=saved,
        pages_sharing=values["pages_sharing"], full_scans=values["full_scans"],
    )  # fmt: skip


def enable_ksm(ksm_dir: Path = KSM_DIR) -> bool:
    """Start ``ksmd`` where it is stopped (``run`` 0), scanning :data:`KSM_PAGES_PER_WAKE`
    pages every :data:`KSM_SLEEP_MS` ms; True when this call started it. A host whose
    operator runs it, or told it to unmerge (``run`` 2), keeps its own settings."""
    try:
        run = int((ksm_dir / "run").read_text())
    except (OSError, ValueError):
        return False  # no KSM in this kernel
    if run != 0:
        return False
    if (ksm_dir / "advisor_mode").exists():
        (ksm_dir / "advisor_mode").write_text("none")  # the fixed rate below, not the advisor's
    (ksm_dir / "pages_to_scan").write_text(str(KSM_PAGES_PER_WAKE))
    (ksm_dir / "sleep_millisecs").write_text(str(KSM_SLEEP_MS))
    (ksm_dir / "run").write_text("1")
    return True
