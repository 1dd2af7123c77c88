"""The seam between the activation recipes and the world they act on: CRIU, the sandbox, the
server's control directory and port, the image checks and the clock.

``donor``, ``copy`` and ``bake`` run their steps only through a :class:`Tools`, so tests run
them without root against fakes (their step order, their cleanup at each failure point, their
reports), while :data:`REAL_TOOLS` does the real thing. The native step (cuda-checkpoint) is
its own seam already (:class:`snapctl.activation.native.NativeStep`).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from snapctl.activation import gate, handshake, launch
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import tree_pids
from snapctl.cgroups import ActivationCgroup
from snapctl.criu import CriuBinary, read_dump_stats, read_restore_stats
from snapctl.criu.external import sandbox_external_mounts
from snapctl.criu.inventory import require_dumpable
from snapctl.criu.kdat import with_private_run
from snapctl.criu.lazy.daemon import LazyPagesDaemon, restore_tree_lazily
from snapctl.criu.ops import dump_tree, restore_tree
from snapctl.criu.stats import DumpStats
from snapctl.images import Manifest, stage_shm_copy, verify_image
from snapctl.images.identity.models import Difference, Identity
from snapctl.images.identity.tree import FileView
from snapctl.namespaces.devices import dev_fstype
from snapctl.namespaces.layout import EXTERNAL_MOUNT_KEYS, ActivationDirs
from snapctl.namespaces.netns import NetnsConnector, Publisher
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.models import CaptureReady
from snapctl.statedir import StateDir
from snapctl.supervision.process import PinnedProcess, become_subreaper


class CriuOps(Protocol):
    """Every CRIU step of a capture or a restore."""

    def for_restores(self, criu: CriuBinary, state: StateDir) -> CriuBinary: ...

    def require_dumpable(self, pids: Iterable[int]) -> None: ...

    def dump(
        self, criu: CriuBinary, root_pid: int, images_dir: Path, log_path: Path, *,
        external_mounts: Mapping[str, str], action_script: Path, timeout_s: float,
    ) -> DumpStats: ...  # fmt: skip

    # ``root``: the tree's root directory (None: CRIU's ``/``; a container's, see container);
    # ``netns``: a network namespace to join (a container's), not a new one.
    def restore(
        self, criu: CriuBinary, images_dir: Path, work_dir: Path, log_path: Path, pidfile: Path,
        *, external_dirs: Mapping[str, Path], timeout_s: float, root: Path | None = None,
        netns: str | None = None,
    ) -> None: ...  # fmt: skip

    # ``restore_criu``: the restore's own criu (one entering a container), the daemon's is
    # ``criu``; ``root``, ``netns``: as ``restore`` takes them.
    def restore_lazily(
        self, criu: CriuBinary, view: Path, work_dir: Path, logs: Path, pidfile: Path, *,
        external_dirs: Mapping[str, Path], timeout_s: float,
        on_daemon_ready: Callable[[LazyPagesDaemon], None], hold_transfer: bool,
        restore_criu: CriuBinary | None = None, root: Path | None = None,
        netns: str | None = None,
    ) -> None: ...  # fmt: skip

    def restore_stats(self, work_dir: Path) -> dict[str, int]: ...


class Sandbox(Protocol):
    """The activation's directories and namespaces, and the tree running in them."""

    def create_dirs(self, dirs: ActivationDirs) -> None: ...

    def launch(
        self, argv: list[str], cwd: Path, dirs: ActivationDirs, options: LaunchOptions,
        env: dict[str, str], *, cgroup: ActivationCgroup | None = None,
    ) -> tuple[subprocess.Popen[bytes], PinnedProcess]: ...  # fmt: skip

    def wait_capture_ready(
        self, dirs: ActivationDirs, root: PinnedProcess, timeout_s: float
    ) -> CaptureReady: ...

    def tree_pids(self, root_pid: int) -> list[int]: ...

    def external_mounts(self, root_pid: int, dirs: ActivationDirs) -> dict[str, str]: ...

    def stage_shm(self, saved: Path, target: Path) -> None: ...

    def dev_fstype(self) -> str | None:
        """What is mounted at this machine's /dev (an image that kept it needs a devtmpfs)."""
        ...

    def adopt_restored_trees(self) -> None: ...


class ServerLink(Protocol):
    """Talking to the server: the activation handshake, the readiness probe, the port."""

    def connect(self, root_pid: int) -> NetnsConnector: ...

    def handshake(
        self, control: ControlDir, *, capture_id: str, activation_id: str,
        kind: Literal["donor", "copy"], host: str | None, port: int, timeout_s: float,
        alive: Callable[[], bool],
    ) -> list[str]: ...  # fmt: skip

    def probe(
        self, connector: NetnsConnector, host: str, port: int, *, api_key: str | None,
        timeout_s: float, alive: Callable[[], bool],
    ) -> float: ...  # fmt: skip

    def publish(
        self, connector: NetnsConnector, address: tuple[str, int], target: tuple[str, int]
    ) -> Publisher: ...


class ImageChecks(Protocol):
    """What an image must satisfy before a restore, and what a capture records."""

    def verify(self, image: Path, state: StateDir) -> Manifest: ...

    def capture_identity(
        self, pids: Iterable[int], *, criu_version: str, server_argv: list[str],
        server_env: Mapping[str, str], state: StateDir,
    ) -> Identity: ...  # fmt: skip

    # ``view``: where the files the copy will read are (a container's; None: ``/``).
    def check_identity(
        self, manifest: Manifest, image: Path, *, criu_version: str, options: LaunchOptions,
        state: StateDir, view: FileView | None = None,
    ) -> list[Difference]: ...  # fmt: skip


class RealCriu:
    def for_restores(self, criu: CriuBinary, state: StateDir) -> CriuBinary:
        # Restores (and lazy-pages daemons) skip CRIU's kernel probe with a cache for this boot.
        return with_private_run(criu, state.criu)

    def require_dumpable(self, pids: Iterable[int]) -> None:
        require_dumpable(list(pids))

    def dump(
        self, criu: CriuBinary, root_pid: int, images_dir: Path, log_path: Path, *,
        external_mounts: Mapping[str, str], action_script: Path, timeout_s: float,
    ) -> DumpStats:  # fmt: skip
        dump_tree(
            criu, root_pid, images_dir, log_path, external_mounts=external_mounts,
            action_script=action_script, timeout_s=timeout_s,
        )  # fmt: skip
        return read_dump_stats(images_dir)

    def restore(
        self, criu: CriuBinary, images_dir: Path, work_dir: Path, log_path: Path, pidfile: Path,
        *, external_dirs: Mapping[str, Path], timeout_s: float, root: Path | None = None,
        netns: str | None = None,
    ) -> None:  # fmt: skip
        restore_tree(
            criu, images_dir, work_dir, log_path, pidfile, external_dirs=external_dirs,
            timeout_s=timeout_s, root=root, netns=netns,
        )  # fmt: skip

    def restore_lazily(
        self, criu: CriuBinary, view: Path, work_dir: Path, logs: Path, pidfile: Path, *,
        external_dirs: Mapping[str, Path], timeout_s: float,
        on_daemon_ready: Callable[[LazyPagesDaemon], None], hold_transfer: bool,
        restore_criu: CriuBinary | None = None, root: Path | None = None,
        netns: str | None = None,
    ) -> None:  # fmt: skip
        restore_tree_lazily(
            criu, view, work_dir, logs, pidfile, external_dirs=external_dirs,
            timeout_s=timeout_s, on_daemon_ready=on_daemon_ready, hold_transfer=hold_transfer,
            restore_criu=restore_criu, root=root, netns=netns,
        )  # fmt: skip

    def restore_stats(self, work_dir: Path) -> dict[str, int]:
        return read_restore_stats(work_dir).model_dump()


class RealSandbox:
    def create_dirs(self, dirs: ActivationDirs) -> None:
        dirs.create()

    def launch(
        self, argv: list[str], cwd: Path, dirs: ActivationDirs, options: LaunchOptions,
        env: dict[str, str], *, cgroup: ActivationCgroup | None = None,
    ) -> tuple[subprocess.Popen[bytes], PinnedProcess]:  # fmt: skip
        return launch.launch_in_sandbox(argv, cwd, dirs, options, env, cgroup)

    def wait_capture_ready(
        self, dirs: ActivationDirs, root: PinnedProcess, timeout_s: float
    ) -> CaptureReady:
        return launch.wait_capture_ready(dirs, root, timeout_s)

    def tree_pids(self, root_pid: int) -> list[int]:
        return tree_pids(root_pid)

    def external_mounts(self, root_pid: int, dirs: ActivationDirs) -> dict[str, str]:
        return sandbox_external_mounts(root_pid, EXTERNAL_MOUNT_KEYS, dirs.host_binds())

    def stage_shm(self, saved: Path, target: Path) -> None:
        stage_shm_copy(saved, target)

    def dev_fstype(self) -> str | None:
        return dev_fstype()

    def adopt_restored_trees(self) -> None:
        # Restored trees are reparented to the nearest subreaper: let that be us.
        become_subreaper()


class RealServerLink:
    def connect(self, root_pid: int) -> NetnsConnector:
        return NetnsConnector(root_pid)

    def handshake(
        self, control: ControlDir, *, capture_id: str, activation_id: str,
        kind: Literal["donor", "copy"], host: str | None, port: int, timeout_s: float,
        alive: Callable[[], bool],
    ) -> list[str]:  # fmt: skip
        return handshake.activate(
            control, capture_id=capture_id, activation_id=activation_id, kind=kind, host=host,
            port=port, timeout_s=timeout_s, alive=alive,
        ).phases  # fmt: skip

    def probe(
        self, connector: NetnsConnector, host: str, port: int, *, api_key: str | None,
        timeout_s: float, alive: Callable[[], bool],
    ) -> float:  # fmt: skip
        return handshake.probe_http_ready(
            connector, host, port, api_key=api_key, timeout_s=timeout_s, alive=alive
        )

    def publish(
        self, connector: NetnsConnector, address: tuple[str, int], target: tuple[str, int]
    ) -> Publisher:
        return Publisher(connector, address[0], address[1], target)


class RealImageChecks:
    def verify(self, image: Path, state: StateDir) -> Manifest:
        return verify_image(image, cache_dir=state.verified)

    def capture_identity(
        self, pids: Iterable[int], *, criu_version: str, server_argv: list[str],
        server_env: Mapping[str, str], state: StateDir,
    ) -> Identity:  # fmt: skip
        return gate.capture_identity(
            pids, criu_version=criu_version, server_argv=server_argv, server_env=server_env,
            state=state,
        )  # fmt: skip

    def check_identity(
        self, manifest: Manifest, image: Path, *, criu_version: str, options: LaunchOptions,
        state: StateDir, view: FileView | None = None,
    ) -> list[Difference]:  # fmt: skip
        return gate.check_identity(
            manifest, image, criu_version=criu_version, options=options, state=state, view=view
        )


@dataclass(frozen=True)
class Tools:
    criu: CriuOps = field(default_factory=RealCriu)
    sandbox: Sandbox = field(default_factory=RealSandbox)
    server: ServerLink = field(default_factory=RealServerLink)
    images: ImageChecks = field(default_factory=RealImageChecks)
    clock: Callable[[], float] = time.monotonic


REAL_TOOLS = Tools()
