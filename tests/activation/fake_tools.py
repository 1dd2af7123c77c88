"""Stand-ins for everything a donor or a copy acts on (CRIU, the sandbox, the server), so
that their steps run without root: each call is recorded, and any step can be made to fail.

The tree is a real ``sleep`` of ours, pinned like a real root, so stopping it is real too.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from snapctl.activation.launch import LaunchOptions
from snapctl.activation.tools import RealImageChecks, Tools
from snapctl.cgroups import ActivationCgroup
from snapctl.criu import CriuBinary
from snapctl.criu.lazy.daemon import LazyPagesDaemon
from snapctl.criu.stats import DumpStats
from snapctl.errors import SnapctlError
from snapctl.images import Manifest, stage_shm_copy
from snapctl.images.identity.models import Difference, Identity
from snapctl.namespaces.layout import ActivationDirs
from snapctl.protocol.controldir import ControlDir
from snapctl.protocol.models import CaptureReady, Oracle
from snapctl.statedir import StateDir
from snapctl.supervision.process import PinnedProcess

CRIU = CriuBinary(path=Path("/bin/false"), version="4.2.1", source="option")
CAPTURE_ID = "c" * 32
ORACLE = Oracle(token_ids=[7], text="x", sampled_token_logprob=-0.25)


class InjectedFailure(SnapctlError):
    """What a step made to fail raises."""


@dataclass
class Steps:
    """The calls so far, in order, and the step that is to fail (if any)."""

    calls: list[str] = field(default_factory=list)
    fail_at: str | None = None
    trees: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __call__(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_at:
            raise InjectedFailure(f"injected failure at {name}", phase=name)

    def start_tree(self) -> PinnedProcess:
        tree = subprocess.Popen(["sleep", "60"])
        self.trees.append(tree)
        return PinnedProcess(tree.pid)

    def trees_running(self) -> list[int]:
        return [tree.pid for tree in self.trees if tree.poll() is None]


class FakeCriu:
    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    def for_restores(self, criu: CriuBinary, state: StateDir) -> CriuBinary:
        return criu

    def require_dumpable(self, pids: Iterable[int]) -> None:
        self.steps("require_dumpable")

    def dump(
        self, criu: CriuBinary, root_pid: int, images_dir: Path, log_path: Path, *,
        external_mounts: Mapping[str, str], action_script: Path, timeout_s: float,
    ) -> DumpStats:  # fmt: skip
        log_path.write_text("fake dump\n")
        self.steps("dump")
        images_dir.mkdir(parents=True, exist_ok=True)
        (images_dir / "pages-1.img").write_bytes(b"\0" * 4096)
        return DumpStats(pages_written=1)

    def restore(
        self, criu: CriuBinary, images_dir: Path, work_dir: Path, log_path: Path, pidfile: Path,
        *, external_dirs: Mapping[str, Path], timeout_s: float, root: Path | None = None,
        netns: str | None = None,
    ) -> None:  # fmt: skip
        self.steps("restore")
        pidfile.write_text(f"{self.steps.start_tree().pid}\n")

    def restore_lazily(
        self, criu: CriuBinary, view: Path, work_dir: Path, logs: Path, pidfile: Path, *,
        external_dirs: Mapping[str, Path], timeout_s: float,
        on_daemon_ready: Callable[[LazyPagesDaemon], None], hold_transfer: bool,
        restore_criu: CriuBinary | None = None, root: Path | None = None,
        netns: str | None = None,
    ) -> None:  # fmt: skip
        raise NotImplementedError("lazy restores are tested with CRIU")

    def restore_stats(self, work_dir: Path) -> dict[str, int]:
        return {"pages_restored": 1}


class FakeSandbox:
    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    def create_dirs(self, dirs: ActivationDirs) -> None:
        self.steps("create_dirs")
        dirs.create(tmpfs=False)

    def launch(
        self, argv: list[str], cwd: Path, dirs: ActivationDirs, options: LaunchOptions,
        env: dict[str, str], *, cgroup: ActivationCgroup | None = None,
    ) -> tuple[subprocess.Popen[bytes], PinnedProcess]:  # fmt: skip
        self.steps("launch")
        launcher = subprocess.Popen(["true"])
        return launcher, self.steps.start_tree()

    def wait_capture_ready(
        self, dirs: ActivationDirs, root: PinnedProcess, timeout_s: float
    ) -> CaptureReady:
        self.steps("wait_capture_ready")
        return CaptureReady(capture_id=CAPTURE_ID, pid=1, oracle=ORACLE)

    def tree_pids(self, root_pid: int) -> list[int]:
        return [root_pid]

    def external_mounts(self, root_pid: int, dirs: ActivationDirs) -> dict[str, str]:
        self.steps("external_mounts")
        return {}

    def stage_shm(self, saved: Path, target: Path) -> None:
        self.steps("stage_shm")
        stage_shm_copy(saved, target)

    def dev_fstype(self) -> str | None:
        return "devtmpfs"

    def adopt_restored_trees(self) -> None:
        pass


class FakeConnector:
    def close(self) -> None:
        pass


class FakePublisher:
    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address

    def close(self) -> None:
        pass


class FakeServer:
    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    def connect(self, root_pid: int) -> FakeConnector:  # type: ignore[override]
        if "connect" not in self.steps.calls:
            self.steps("connect")
        return FakeConnector()

    def handshake(
        self, control: ControlDir, *, capture_id: str, activation_id: str,
        kind: Literal["donor", "copy"], host: str | None, port: int, timeout_s: float,
        alive: Callable[[], bool],
    ) -> list[str]:  # fmt: skip
        self.steps("handshake")
        assert capture_id == CAPTURE_ID and alive()
        return ["restore", "validate"]

    def probe(
        self, connector: object, host: str, port: int, *, api_key: str | None,
        timeout_s: float, alive: Callable[[], bool],
    ) -> float:  # fmt: skip
        self.steps("probe")
        return 0.001

    def publish(
        self, connector: object, address: tuple[str, int], target: tuple[str, int]
    ) -> FakePublisher:
        self.steps("publish")
        return FakePublisher(address)


class FakeImages(RealImageChecks):
    """Real verification (the image is real), fake identities (no file of the fake tree's)."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps

    def verify(self, image: Path, state: StateDir) -> Manifest:
        self.steps("verify")
        return super().verify(image, state)

    def capture_identity(
        self, pids: Iterable[int], *, criu_version: str, server_argv: list[str],
        server_env: Mapping[str, str], state: StateDir,
    ) -> Identity:  # fmt: skip
        self.steps("capture_identity")
        return super().capture_identity(
            [], criu_version=criu_version, server_argv=server_argv, server_env={}, state=state
        )

    def check_identity(
        self, manifest: Manifest, image: Path, *, criu_version: str, options: LaunchOptions,
        state: StateDir,
    ) -> list[Difference]:  # fmt: skip
        self.steps("check_identity")
        return []


def fake_tools(steps: Steps) -> Tools:
    ticks = iter(range(1_000_000))
    return Tools(
        criu=FakeCriu(steps),
        sandbox=FakeSandbox(steps),
        server=FakeServer(steps),  # type: ignore[arg-type]
        images=FakeImages(steps),
        clock=lambda: float(next(ticks)),
    )
