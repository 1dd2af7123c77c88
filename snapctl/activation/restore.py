"""Restoring a copy's tree from an image, plain or lazy: two strategies behind one call.

Both stage the copy's ``/dev/shm`` and restore into fresh namespaces; the session ends
``restored`` with its tree pinned and its :mod:`memory <snapctl.activation.memory>` saying how
its pages arrive. Plain: every page is in place when CRIU returns, so the image is let go at
once. Lazy: the tree runs while a ``criu lazy-pages`` daemon of its own serves its faults and
streams the rest (:mod:`snapctl.criu.lazy`); the image stays held until every page is in.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from abc import ABC, abstractmethod
from pathlib import Path

from snapctl.activation.memory import LazyPages
from snapctl.activation.session import Session
from snapctl.activation.states import SessionState
from snapctl.activation.tools import Tools
from snapctl.criu import CriuBinary, CriuError
from snapctl.criu.external import host_mount_sources, is_host_key
from snapctl.criu.lazy.daemon import LazyPagesDaemon
from snapctl.criu.lazy.netdumps import joined_view, network_state_dumps, redundant_net_dumps
from snapctl.criu.lazy.pagemap import cache_views, lazy_view
from snapctl.criu.lazy.transfer import LazyTransfer
from snapctl.criu.lazy.workingset import record_working_sets
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.images import Manifest
from snapctl.namespaces.devices import require_restorable_dev
from snapctl.phases import HostPhase
from snapctl.progress import Progress
from snapctl.supervision.process import PinnedProcess


class RestoreError(SnapctlError):
    """CRIU could not restore the image; nothing of the copy was left running."""

    exit_status = ExitStatus.ACTIVATION_FAILED


class RestoreStrategy(ABC):
    """One way of restoring a copy's tree, acting through ``tools``."""

    name: str

    def __init__(self, tools: Tools) -> None:
        self._tools = tools

    @abstractmethod
    def restore(
        self, session: Session, image: Path, external_dirs: dict[str, Path], *,
        criu: CriuBinary, host_criu: CriuBinary, timeout_s: float, timings: dict[str, float],
    ) -> None:  # fmt: skip
        """Restore the tree with ``criu`` (which enters the session's container, if it has
        one), helpers with ``host_criu`` (which does not); the tree's pid is in
        ``session.dirs.work / "root.pid"`` when it returns."""


def placement(session: Session) -> tuple[Path | None, str | None]:
    """The tree's root directory and the network namespace it joins, as CRIU sees them: those
    of the session's container, or (None, None) for CRIU's own root and a new namespace."""
    if session.container is None:
        return None, None
    return session.container.root_bind(session.dirs.work), session.container.netns


class PlainRestore(RestoreStrategy):
    name = "plain"

    def restore(
        self, session: Session, image: Path, external_dirs: dict[str, Path], *,
        criu: CriuBinary, host_criu: CriuBinary, timeout_s: float, timings: dict[str, float],
    ) -> None:  # fmt: skip
        started = self._tools.clock()
        images = image / "criu"
        root, netns = placement(session)
        if netns is not None:
            # The tree joins a network namespace that exists: the image's own network state
            # stays out of it (netdumps.network_state_dumps).
            images = session.dirs.work / "images"
            try:
                joined_view(image / "criu", images)
            except OSError as error:
                raise RestoreError(f"cannot build the restore's image view: {error}",
                                   phase=HostPhase.RESTORE, path=images) from error  # fmt: skip
        try:
            self._tools.criu.restore(
                criu, images, session.dirs.work, session.dirs.logs / "restore.log",
                pidfile(session), external_dirs=external_dirs, timeout_s=timeout_s, root=root,
                netns=netns,
            )  # fmt: skip
        except SnapctlError as error:
            raise criu_failed("criu restore failed", error, session, "restore") from error
        timings["restore"] = self._tools.clock() - started


class LazyRestore(RestoreStrategy):
    """``--lazy-pages`` with the copy's own lazy-pages daemon on its own work dir, started
    together; the session's memory watches the daemon from the moment it listens. Both read the
    image through a view in the work dir in which only big runs of memory stay lazy and the
    network dumps that restore nothing are left out. With much memory left lazy, the daemon's
    background transfer is held back until the copy is ready: until then it only serves faults.
    ``hold_transfer`` decides that instead of the view (the lazy-fault run holds it always, so
    that its daemon has not begun to push pages when it is paused).
    """

    name = "lazy"

    def __init__(self, tools: Tools, *, hold_transfer: bool | None = None) -> None:
        super().__init__(tools)
        self._hold_transfer = hold_transfer

    def restore(
        self, session: Session, image: Path, external_dirs: dict[str, Path], *,
        criu: CriuBinary, host_criu: CriuBinary, timeout_s: float, timings: dict[str, float],
    ) -> None:  # fmt: skip
        clock = self._tools.clock
        view_started = clock()
        view = session.dirs.work / "images"
        root, netns = placement(session)
        try:
            omit = (
                redundant_net_dumps(image / "criu")
                if netns is None
                else network_state_dumps(image / "criu")
            )
            summary = lazy_view(image / "criu", view, cache_dir=session.state_dir.views, omit=omit)
        except (SnapctlError, OSError) as error:
            raise RestoreError(
                f"cannot build the lazy restore's image view: {error}",
                phase=HostPhase.RESTORE,
                path=view,
            ) from error
        timings["lazy_view"] = clock() - view_started
        # Monotonic, whatever the tools' clock: the transfer reports when its last page came.
        restore_started = time.monotonic()
        started = clock()

        def watch(daemon: LazyPagesDaemon) -> None:
            # From now on a daemon that dies, during the restore or after, fails the copy.
            timings["lazy_pages_start"] = clock() - started
            session.memory = LazyPages(
                LazyTransfer(
                    daemon, restore_started=restore_started, on_failure=session.kill_unsafe,
                    on_done=session.pages_done,
                    learn=lambda until_s: learn_working_sets(
                        image / "criu", session.state_dir.views, daemon.log_path, until_s
                    ),
                )
            )  # fmt: skip

        try:
            # The daemon runs here; only the restore enters a container.
            self._tools.criu.restore_lazily(
                host_criu, view, session.dirs.work, session.dirs.logs, pidfile(session),
                external_dirs=external_dirs, timeout_s=timeout_s, on_daemon_ready=watch,
                hold_transfer=(
                    summary.holds_transfer if self._hold_transfer is None else self._hold_transfer
                ),
                restore_criu=criu, root=root, netns=netns,
            )  # fmt: skip
        except SnapctlError as error:
            if isinstance(error, CriuError) and error.action == "lazy-pages":
                raise criu_failed(
                    "criu lazy-pages failed to start", error, session, "lazy-pages"
                ) from error
            # Its daemon ends with the failed restore: a consequence, not the cause.
            session.memory.stop()
            session.failure = None
            raise criu_failed("criu restore failed", error, session, "restore") from error
        timings["restore"] = clock() - started


def learn_working_sets(images_dir: Path, views: Path, log_path: Path, until_s: float) -> None:
    """A lazy copy's faults into its image's working sets; where they changed, the next copy's
    view is made now, so that copy does not pay for it."""
    if record_working_sets(images_dir, views, log_path, until_s):
        cache_views(images_dir, views)


def pidfile(session: Session) -> Path:
    return session.dirs.work / "root.pid"


def pin_restored(session: Session) -> None:
    """Pin the tree CRIU restored (also after an interrupted restore, if its pidfile exists)."""
    pid = int(pidfile(session).read_text().strip())
    if session.container is not None:
        # CRIU ran in the container's PID namespace and wrote the PID it saw there.
        pid = session.container.host_pid(pid)
    session.root = PinnedProcess(pid)


def restore_tree(
    session: Session,
    image: Path,
    manifest: Manifest,
    strategy: RestoreStrategy,
    *,
    criu: CriuBinary,
    timeout_s: float,
    timings: dict[str, float],
    progress: Progress,
    tools: Tools,
) -> None:
    """Stage the copy's directories and restore its tree with ``strategy``; the session goes
    from created through restoring to restored, its tree pinned as ``session.root``."""
    require_restorable_dev(manifest.sandbox_dev, tools.sandbox.dev_fstype())
    session.advance(SessionState.RESTORING)
    progress("staging the copy's directories")
    started = tools.clock()
    tools.sandbox.stage_shm(image / "shm", session.dirs.shm)
    timings["stage"] = tools.clock() - started
    container = session.container
    external_dirs = {
        **{k: session.dirs.host_dir_for(k) for k in manifest.external_mounts if not is_host_key(k)},
        **(
            host_mount_sources(manifest.external_mounts)
            if container is None
            else container.mount_sources(manifest.external_mounts, session.dirs.work)
        ),
    }
    progress("restoring with CRIU")
    tree_criu = criu
    if container is not None:
        # Last look before CRIU: a container that stopped meanwhile is refused, not entered.
        container.require_alive()
        tree_criu = container.criu(criu, session.dirs.work, manifest.external_mounts)
    if session.cgroup is not None:
        # CRIU restore enters the copy's cgroup before it forks the tree (restored with
        # --manage-cgroups=ignore): every process and page of the copy is the cgroup's.
        cgroup = session.cgroup
        criu, tree_criu = (
            dataclasses.replace(each, command=tuple(cgroup.enter_argv([*each.argv])))
            for each in (criu, tree_criu)
        )
    strategy.restore(session, image, external_dirs, criu=tree_criu, host_criu=criu,
                     timeout_s=timeout_s, timings=timings)  # fmt: skip
    pin_restored(session)
    if container is not None:
        try:
            # Parked at the barrier until activated: it writes nothing there before this.
            container.keep_read_only(session.tree.pid, manifest.external_mounts)
        except (OSError, subprocess.SubprocessError) as error:
            raise RestoreError(str(error), phase=HostPhase.RESTORE) from error
    session.remember_tree()
    session.advance(SessionState.RESTORED)
    pages = session.memory.status()
    if pages is None:
        session.release_image()
    elif pages.state == "failed":
        # It died before we could pin the tree, so its watcher had nothing to kill yet.
        session.kill_unsafe(pages.failure or "lazy-pages daemon failed")


def criu_failed(what: str, error: SnapctlError, session: Session, log: str) -> RestoreError:
    """The restore's error for a CRIU step that failed, pointing at that step's log."""
    return RestoreError(
        f"{what}: {error.message}",
        phase=HostPhase.RESTORE,
        path=session.dirs.logs / f"{log}.log",
        log_tail=error.log_tail,
    )


def strategy_for(lazy: bool, tools: Tools, *, hold_transfer: bool | None = None) -> RestoreStrategy:
    if lazy:
        return LazyRestore(tools, hold_transfer=hold_transfer)
    return PlainRestore(tools)
