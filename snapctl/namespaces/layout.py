"""Where an activation's files live on the host and inside its sandbox."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from snapctl.models import StrictModel
from snapctl.namespaces import mounts
from snapctl.protocol.atomic import write_json_atomic
from snapctl.supervision.process import is_same_process, start_time

SANDBOX_CONTROL_DIR = "/run/snapctl/control"
SANDBOX_LOGS_DIR = "/run/snapctl/logs"
SANDBOX_LOG_FILE = f"{SANDBOX_LOGS_DIR}/server.log"
SANDBOX_SHM_DIR = "/dev/shm"
# ``.ID.creating``: an activation directory being made (see ActivationDirs.create).
CREATING_SUFFIX = ".creating"
# The module the launcher runs as the sandbox's first process (``python -m``, see ``init``).
SANDBOX_INIT_MODULE = "snapctl.namespaces.init"

# The control directory is a tmpfs of its own: the protocol fsyncs every file and the directory
# on each write (five writes per handshake), which on a disk costs a journal commit each and
# nothing on tmpfs. Small: six files of at most 64 KiB each, plus a write's .tmp.
CONTROL_TMPFS_OPTIONS = "mode=0700,size=1m,nr_inodes=64"
# How long a removal waits for a tmpfs to stop being busy once the processes are gone.
UMOUNT_BUSY_WAIT_S = 2.0
CONTROL_TMPFS_FLAGS = mounts.MS_NOSUID | mounts.MS_NODEV | mounts.MS_NOEXEC

# CRIU external-mount keys: the image records these instead of the host directories, and
# each restore maps them to that activation's own directories.
EXTERNAL_MOUNT_KEYS = {
    "control": SANDBOX_CONTROL_DIR,
    "logs": SANDBOX_LOGS_DIR,
    "shm": SANDBOX_SHM_DIR,
}


class BindMount(StrictModel):
    """A host directory bind-mounted at a fixed path inside the sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str
    target: str
    # A path the server named, resolved by snapctl: bound only if no component is a symlink
    # by then (one swapped in after the resolution is refused, not followed).
    no_symlinks: bool = False


class SandboxSpec(BaseModel):
    """What the in-namespace init does before it executes the server (see ``init``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[str]
    cwd: str
    env: dict[str, str]
    binds: list[BindMount]
    log_file: str = SANDBOX_LOG_FILE
    lo_addresses: list[str] = []
    hostname: str = "snapctl"


class ActivationOwner(BaseModel):
    """The snapctl process that created (and cleans up) an activation: ``owner.json``."""

    pid: int
    start_time: float

    @classmethod
    def current(cls) -> ActivationOwner:
        return cls(pid=os.getpid(), start_time=start_time(os.getpid()))

    def alive(self) -> bool:
        return is_same_process(self.pid, self.start_time)


@dataclass(frozen=True)
class ActivationDirs:
    """The host directories of one activation (donor or copy).

    ``root`` holds ``control`` (an empty 0700 tmpfs), ``shm`` (a tmpfs) and ``work`` (CRIU's
    work dir); ``logs`` lives apart so it survives the activation's cleanup. Both tmpfs are
    mounted in the host's mount namespace and carry source names unique to the activation.
    """

    root: Path
    logs: Path

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def shm(self) -> Path:
        return self.root / "shm"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def sandbox_spec(self) -> Path:
        """The :class:`SandboxSpec` the sandbox was launched with (donors only)."""
        return self.root / "sandbox.json"

    def host_binds(self) -> list[str]:
        """The host paths the launched sandbox binds at the same place inside
        (``hostview.host_binds``)."""
        spec = SandboxSpec.model_validate_json(self.sandbox_spec.read_bytes())
        return [b.target for b in spec.binds if b.host == b.target]

    @property
    def owner_file(self) -> Path:
        return self.root / "owner.json"

    def owner(self) -> ActivationOwner | None:
        """Who created this activation; None if unknown (torn or missing file)."""
        try:
            return ActivationOwner.model_validate_json(self.owner_file.read_bytes())
        except (OSError, ValueError):
            return None

    @property
    def server_log(self) -> Path:
        return self.logs / "server.log"

    @property
    def launcher_log(self) -> Path:
        """What the sandbox's own start wrote (unshare, the sandbox's init): the reason where
        the server never started."""
        return self.logs / "launcher.log"

    def host_dir_for(self, key: str) -> Path:
        return {"control": self.control, "logs": self.logs, "shm": self.shm}[key]

    @property
    def mount_source(self) -> str:
        """The shm tmpfs's source name: unique per activation, so its processes can be found."""
        return f"snapctl-{self.root.name}"

    @property
    def control_source(self) -> str:
        """The control tmpfs's source name: distinct from :attr:`mount_source`, which alone
        identifies the activation's processes (by where they see it: /dev/shm)."""
        return f"snapctl-control-{self.root.name}"

    def processes(self) -> list[int]:
        """Every process inside this activation's sandbox (see ``mounts.processes_with_mount``),
        and its launcher and init while they set the sandbox up (:meth:`launching`)."""
        # Argv first, mounts second. An init goes from "its argv names the spec" to "the tmpfs
        # is at /dev/shm" (bind, then exec), and it cannot go back: one the argv scan misses had
        # exec'd, so bound, before the mount scan began. The other order misses an init that
        # binds and execs between the two scans.
        launching = self.launching()
        inside = mounts.processes_with_mount(self.mount_source, SANDBOX_SHM_DIR)
        return sorted({*launching, *inside})

    def launching(self) -> list[int]:
        """The launcher (``unshare``) and the sandbox's init until it execs the server: both
        name this activation's sandbox spec in their argv.

        Until the init has bound the activation's tmpfs at /dev/shm, its mount table shows that
        tmpfs at its host path only, as any namespace being set up does, so only its argv finds
        it. It must be found: it holds clones of the activation's directories, so once they are
        removed it still binds them and execs the server, in a sandbox nothing can find by its
        directory any more. The bind comes before the exec, so one of the two always holds.
        """
        from snapctl.supervision.process import each_argv

        spec = str(self.sandbox_spec)
        return sorted(
            pid for pid, argv in each_argv() if SANDBOX_INIT_MODULE in argv and spec in argv
        )

    def binds(self) -> list[BindMount]:
        return [
            BindMount(host=str(self.host_dir_for(key)), target=target)
            for key, target in EXTERNAL_MOUNT_KEYS.items()
        ]

    @property
    def creating(self) -> Path:
        """Where ``root`` is made with its owner file, before it appears under its name."""
        return self.root.parent / f".{self.root.name}{CREATING_SUFFIX}"

    def create(self, shm_size: str = "50%", *, tmpfs: bool = True) -> None:
        """Make fresh directories and mount both tmpfs; on failure none is left mounted and
        ``root`` is removed again (the logs stay). Without ``tmpfs`` (tests without root) the
        directories stay plain.

        ``root`` appears with its owner file already in it (made beside it, then renamed), so
        ``snapctl gc`` never meets an activation without an owner to judge it by.
        """
        self.root.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        self.creating.mkdir(mode=0o700)
        try:
            owner = ActivationOwner.current().model_dump(mode="json")
            write_json_atomic(self.creating / self.owner_file.name, owner)
            os.rename(self.creating, self.root)
        except BaseException:
            shutil.rmtree(self.creating, ignore_errors=True)
            raise
        try:
            self.control.mkdir(mode=0o700)
            self.shm.mkdir(mode=0o755)
            self.work.mkdir(mode=0o700)
            self.logs.mkdir(parents=True, mode=0o700, exist_ok=True)
            # CRIU checks a restored log's mode against the dump: always create it 0600.
            fd = os.open(self.server_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.close(fd)
            os.chmod(self.server_log, 0o600)
            if tmpfs:
                mounts.mount_tmpfs(
                    self.control,
                    CONTROL_TMPFS_OPTIONS,
                    source=self.control_source,
                    flags=CONTROL_TMPFS_FLAGS,
                )
                mounts.mount_tmpfs(self.shm, f"mode=1777,size={shm_size}", source=self.mount_source)
        except BaseException:
            # Nothing runs in the activation yet, so both unmounts succeed; the primary error
            # is what the caller must see.
            with contextlib.suppress(OSError):
                self.remove()
            raise

    def remove(self, busy_wait_s: float = UMOUNT_BUSY_WAIT_S) -> None:
        """Unmount both tmpfs and delete everything but the logs (processes must be gone).

        Every unmount is tried even if one fails; then the first failure is raised and the
        directories are kept (they still hold whatever stayed mounted). A mount still busy is
        retried for up to ``busy_wait_s``: the files of processes just ended may be released a
        moment after the processes are (the kernel defers some final closes to a worker).
        """
        failures: list[OSError] = []
        for point in (self.control, self.shm):
            try:
                if mounts.is_mountpoint(point):
                    mounts.umount_when_free(point, busy_wait_s)
            except OSError as error:
                failures.append(error)
        if failures:
            raise failures[0]
        shutil.rmtree(self.root, ignore_errors=False)
