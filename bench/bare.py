"""The baselines snapctl is measured against: a bare ``criu restore`` of a snapctl image plus
the least a capturer must do (stage ``/dev/shm`` and the external mounts, write the protocol
files directly), and a bare ``criu dump --leave-running`` of a tree at capture-ready.

Deliberately written without snapctl's orchestration: raw CRIU argv through the same binary,
CRIU's default log level, no verification, no fsync, no watcher thread, no pydantic.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from snapctl.criu.external import is_host_key
from snapctl.namespaces import mounts

# The CRIU options this kind of tree needs (not snapctl overhead: any capturer needs them).
TREE_OPTIONS = (
    "--tcp-established", "--ext-unix-sk", "--link-remap", "--file-locks",
    "--network-lock", "skip",
)  # fmt: skip
# Where the server expects its control dir, logs and /dev/shm (external mounts in the image).
EXTERNAL = {"control": "/run/snapctl/control", "logs": "/run/snapctl/logs", "shm": "/dev/shm"}
HANDSHAKE_POLL_S = 0.001
INNER_HOST, INNER_PORT = "127.0.0.1", 8000


class BareError(RuntimeError):
    """The bare baseline failed (CRIU or the server refused)."""


@dataclass
class BareCopy:
    """A tree restored by bare CRIU, and its phase timings in seconds."""

    root: Path
    pid: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    # From status.json "recovering" to "validated": the server's own recovery work.
    recovery_s: float | None = None

    def stop(self) -> None:
        """SIGKILL to PID 1 ends the namespace; reap it (we are its subreaper), clean up."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = 0
        shm = self.root / "shm"
        if shm.exists() and os.path.ismount(shm):
            mounts.umount(shm)
        shutil.rmtree(self.root, ignore_errors=True)


def _stage_shm(source: Path, target: Path) -> None:
    """Copy the saved /dev/shm with hard links kept (sem.NAME and link_remap.N are one inode)."""
    seen: dict[int, Path] = {}
    for path in sorted(source.iterdir()):
        st = path.lstat()
        if st.st_ino in seen:
            os.link(seen[st.st_ino], target / path.name)
        else:
            shutil.copy2(path, target / path.name)
            seen[st.st_ino] = target / path.name


def _errors(log: Path) -> str:
    """The log's last error lines (the directory holding it is removed on failure)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as error:
        return f"no log ({error.strerror})"
    noise = ("iptables", "Address already assigned", "address already assigned", "RLIMIT")
    errors = [x for x in lines if "Error" in x and not any(n in x for n in noise)]
    return " | ".join(errors[-3:] or lines[-3:])


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    os.replace(tmp, path)


def _wait_file(path: Path, error: Path, deadline: float) -> bytes:
    while time.monotonic() < deadline:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            if error.exists():
                raise BareError(f"server wrote error.json: {error.read_text()}") from None
            time.sleep(HANDSHAKE_POLL_S)
    raise BareError(f"{path.name} did not appear in time")


def restore(criu: Path, image: Path, root: Path, timeout_s: float = 300.0) -> BareCopy:
    """Restore ``image`` (a snapctl image directory) and run the handshake to validated."""
    copy = restore_tree(criu, image, root)
    try:
        started = time.monotonic()
        recovering = handshake(copy, image, timeout_s)
        done = time.monotonic()
        copy.timings["handshake"] = done - started
        if recovering is not None:
            copy.recovery_s = done - recovering
        return copy
    except BaseException:
        copy.stop()
        raise


def restore_tree(criu: Path, image: Path, root: Path) -> BareCopy:
    """Stage the copy's directories and run ``criu restore``; the tree waits for activation."""
    copy = BareCopy(root=root)
    started = time.monotonic()
    try:
        control, logs, shm, work = (root / name for name in ("control", "logs", "shm", "work"))
        root.mkdir(mode=0o700)
        for directory in (control, logs, work):
            directory.mkdir(mode=0o700)
        shm.mkdir(mode=0o755)
        fd = os.open(logs / "server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.close(fd)
        mounts.mount_tmpfs(shm, "mode=1777")
        _stage_shm(image / "shm", shm)
        staged = time.monotonic()
        copy.timings["stage"] = staged - started

        pidfile = work / "root.pid"
        argv = [
            str(criu), "restore", "-D", str(image / "criu"), "-W", str(work),
            "-o", str(work / "restore.log"), "-d", "--root", "/", "--pidfile", str(pidfile),
            *TREE_OPTIONS,
        ]  # fmt: skip
        for key, host_dir in (("control", control), ("logs", logs), ("shm", shm)):
            argv += ["--external", f"mnt[{key}]:{host_dir}"]
        # Host mounts the image binds back at their own paths (a model directory under /tmp).
        external = json.loads((image / "manifest.json").read_bytes())["external_mounts"]
        for key, point in external.items():
            if is_host_key(key):
                argv += ["--external", f"mnt[{key}]:{point}"]
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
        copy.timings["criu"] = time.monotonic() - staged
        if proc.returncode != 0:
            raise BareError(
                f"criu restore exited {proc.returncode}: {_errors(work / 'restore.log')}"
            )
        copy.pid = int(pidfile.read_text())
        return copy
    except BaseException:
        copy.stop()
        raise


def handshake(copy: BareCopy, image: Path, timeout_s: float) -> float | None:
    """activation -> challenge -> release -> validated, with the files written and read
    directly; returns when status.json was first seen "recovering" (None if never)."""
    control = copy.root / "control"
    capture_id = json.loads((image / "manifest.json").read_bytes())["capture_id"]
    activation = {
        "activation_id": f"bare-{copy.root.name}", "capture_id": capture_id, "host": INNER_HOST,
        "kind": "copy", "native_complete": True, "port": INNER_PORT, "version": 1,
    }  # fmt: skip
    deadline = time.monotonic() + timeout_s
    error = control / "error.json"
    _write(control / "activation.json", json.dumps(activation, separators=(",", ":")).encode())
    challenge = _wait_file(control / "challenge.json", error, deadline)
    _write(control / "release.json", challenge)
    recovering: float | None = None
    while True:
        status = json.loads(_wait_file(control / "status.json", error, deadline))
        if status["phase"] == "validated":
            return recovering
        recovering = recovering or time.monotonic()
        time.sleep(HANDSHAKE_POLL_S)


def dump(criu: Path, root_pid: int, images: Path, verbose: bool = False) -> float:
    """``criu dump --leave-running`` of the tree at ``root_pid``; return the dump's wall time.
    ``verbose`` adds ``-v4`` (snapctl's log level), to show what the log level costs."""
    images.mkdir(mode=0o700)
    argv = [
        str(criu), "dump", "-t", str(root_pid), "-D", str(images), "-o", str(images / "dump.log"),
        "--leave-running", *TREE_OPTIONS, *(["-v4"] if verbose else []),
    ]  # fmt: skip
    for key, target in EXTERNAL.items():
        argv += ["--external", f"mnt[{target}]:{key}"]
    started = time.monotonic()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise BareError(f"criu dump exited {proc.returncode}: {_errors(images / 'dump.log')}")
    return seconds
