"""The CRIU dump and restore that snapctl performs, with the options this layout needs."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path

from snapctl.criu.locate import CriuBinary
from snapctl.criu.run import (
    CriuResult,
    run_criu,
)

# CRIU writes its dump log while the tree is frozen, and its debug lines cost frozen time, more
# the more memory is retained (docs/criu.md, docs/benchmarks.md: the donor pause). Info level
# still logs every step, warning and error; rerun the recorded argv with -v4 to debug.
DUMP_LOG_LEVEL = 3
# Restores and lazy-pages daemons log at info level too: at debug level (a line per VMA, page
# read and transferred chunk) a lazy copy's restore and its background transfer took longer
# (docs/criu.md).
RESTORE_LOG_LEVEL = 3
INVENTORY = "inventory.img"

# Options shared by dump and restore: the tree's loopback TCP connection (a TCPStore-like
# peer) and Unix sockets, glibc named semaphores (link remaps), file locks; no iptables
# network lock (not installed, and the tree's connections are its own, on the loopback of its
# own netns or of the container it is restored into).
TREE_OPTIONS: tuple[str, ...] = (
    "--tcp-established",
    "--ext-unix-sk",
    "--link-remap",
    "--file-locks",
    "--network-lock",
    "skip",
)

ACTION_SCRIPT = """#!/bin/sh
# Written by snapctl. At post-dump the tree is still frozen: copy the activation's /dev/shm,
# hard links kept (cp -a), before CRIU deletes its link_remap files. A failure fails the dump.
set -eu
if [ "$CRTOOLS_SCRIPT_ACTION" = post-dump ]; then
    cp -a "/proc/$CRTOOLS_INIT_PID/root/dev/shm/." {shm_target}
fi
exit 0
"""


def write_action_script(path: Path, shm_target: Path) -> Path:
    """Create the post-dump action script that snapshots /dev/shm into ``shm_target``."""
    path.write_text(ACTION_SCRIPT.format(shm_target=shlex.quote(str(shm_target))))
    path.chmod(0o700)
    return path


def dump_tree(
    criu: CriuBinary,
    root_pid: int,
    images_dir: Path,
    log_path: Path,
    *,
    external_mounts: Mapping[str, str],
    action_script: Path,
    timeout_s: float,
    leave_running: bool = True,
    env: Mapping[str, str] | None = None,
) -> CriuResult:
    """``criu dump`` the tree rooted at ``root_pid`` (PID 1 of its namespaces)."""
    args = ["--tree", str(root_pid), *TREE_OPTIONS, "--action-script", str(action_script)]
    if leave_running:
        args.append("--leave-running")
    for key, target in external_mounts.items():
        args += ["--external", f"mnt[{target}]:{key}"]
    return run_criu(
        criu, "dump", images_dir, log_path, args, timeout_s=timeout_s, env=env,
        log_level=DUMP_LOG_LEVEL,
    )  # fmt: skip


def restore_tree(
    criu: CriuBinary,
    images_dir: Path,
    work_dir: Path,
    log_path: Path,
    pidfile: Path,
    *,
    external_dirs: Mapping[str, Path],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    lazy: bool = False,
    root: Path | None = None,
    netns: str | None = None,
) -> CriuResult:
    """``criu restore`` detached into new namespaces; the image directory is only read.

    With ``lazy``, private anonymous memory is left to the lazy-pages daemon already listening
    in ``work_dir`` (see :func:`spawn_lazy_pages_daemon`; :func:`restore_tree_lazily` starts
    both at once): the tree runs as soon as CRIU returns. ``root``: the tree's root
    directory (None: CRIU's own ``/``). ``netns``: a network namespace for the tree to join, as
    CRIU's ``/proc`` names it, instead of a new one (None: new).
    """
    args = restore_args(work_dir, pidfile, external_dirs, lazy=lazy, root=root, netns=netns)
    return run_criu(
        criu, "restore", images_dir, log_path, args, timeout_s=timeout_s, env=env,
        log_level=RESTORE_LOG_LEVEL,
    )  # fmt: skip


def restore_args(
    work_dir: Path,
    pidfile: Path,
    external_dirs: Mapping[str, Path],
    *,
    lazy: bool,
    root: Path | None = None,
    netns: str | None = None,
) -> list[str]:
    args = ["--work-dir", str(work_dir), "--restore-detached", "--root", str(root or "/")]
    if netns is not None:
        # CRIU restores whatever network dumps it finds into the namespace it joins: the images
        # directory must hold none (netdumps.joined_view).
        args += ["--join-ns", f"net:{netns}"]
    args += ["--pidfile", str(pidfile), *TREE_OPTIONS]
    # The tree stays in the cgroup ``criu restore`` runs in (the copy's own, see
    # snapctl.cgroups), not moved into the cgroups the image recorded (the donor's).
    args.append("--manage-cgroups=ignore")
    if lazy:
        args.append("--lazy-pages")
    for key, directory in external_dirs.items():
        args += ["--external", f"mnt[{key}]:{directory}"]
    return args
