"""A real OCI distribution registry for tests: Debian's ``docker-registry`` (CNCF distribution
2.8) on loopback, its config and storage in a temp dir, stopped by PID after."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

BINARY = "docker-registry"
CONFIG = """version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: {host}:{port}
{auth}"""
HTPASSWD_AUTH = """auth:
  htpasswd:
    realm: snapctl-test
    path: {path}
"""


@dataclass
class RegistryServer:
    """A running registry: ``address`` (host:port) and where it keeps blobs."""

    host: str
    port: int
    storage: Path
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def blob_data(self, digest: str) -> Path:
        """The file the registry serves a blob from (filesystem driver layout)."""
        hex_digest = digest.removeprefix("sha256:")
        return (self.storage / "docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest
                / "data")  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def registry_binary() -> str | None:
    return shutil.which(BINARY)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def start_registry(
    root: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    popen_prefix: tuple[str, ...] = (),
    timeout_s: float = 30.0,
    htpasswd: tuple[str, str] | None = None,
) -> RegistryServer:
    """Start a registry listening on ``host`` (``popen_prefix`` may enter a namespace)."""
    binary = registry_binary()
    assert binary is not None, f"{BINARY} is not installed (scripts/setup installs it)"
    storage = root / "storage"
    storage.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host if not popen_prefix else "127.0.0.1")
    config = root / "config.yml"
    auth = ""
    if htpasswd is not None:  # basic auth, as a registry behind docker login would ask
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # libxcrypt's bcrypt, the only hash the registry accepts

        user, password = htpasswd
        (root / "htpasswd").write_text(
            f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n"
        )
        auth = HTPASSWD_AUTH.format(path=root / "htpasswd")
    config.write_text(CONFIG.format(storage=storage, host=host, port=port, auth=auth))
    log = root / "registry.log"
    with log.open("wb") as out:
        process = subprocess.Popen([*popen_prefix, binary, "serve", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    server = RegistryServer(host, port, storage, process, log)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the registry exited: {log.read_text()[-2000:]}")
        try:
            if not popen_prefix:
                try:
                    with urllib.request.urlopen(f"http://{server.address}/v2/", timeout=2):
                        return server
                except urllib.error.HTTPError as error:
                    if error.code == 401:  # up, and asking for credentials
                        return server
                    raise
            else:
                probe = subprocess.run([*popen_prefix, "python3", "-c",
                                        "import urllib.request as u; "
                                        f"u.urlopen('http://{server.address}/v2/', timeout=2)"],
                                       capture_output=True, timeout=10)  # fmt: skip
                if probe.returncode == 0:
                    return server
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"the registry did not answer: {log.read_text()[-2000:]}")
        time.sleep(0.1)
