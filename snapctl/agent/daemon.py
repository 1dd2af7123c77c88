"""``snapctl agent``: start (one agent per state directory), serve until SIGTERM/SIGINT, stop.

Order matters: the spawner is forked before any thread exists (see :mod:`snapctl.pool.spawner`);
the pool adopts what an earlier agent left before the socket accepts requests; at the end the
listeners close first, then the pool discards its parked copies. Copies the agent served keep
running in their own supervisors throughout, and a new agent simply finds their records.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from snapctl.agent import SOCKET_NAME
from snapctl.agent.metrics import AgentMetrics
from snapctl.agent.server import (
    BusyLimit,
    Router,
    TCPHTTPServer,
    UnixHTTPServer,
    handler_for,
    log,
)
from snapctl.agent.service import AgentService
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool import Spawner, WarmPool
from snapctl.statedir import StateDir
from snapctl.statedir.flock import try_lock
from snapctl.supervision.listing import activation_rows
from snapctl.supervision.memory import enable_ksm

# How long a stopping agent lets the requests it is answering finish (a copy's restore).
IN_FLIGHT_WAIT_S = 60.0
# How long it lets ``logs -f`` streams, told to end, tell their clients so.
FOLLOWERS_END_WAIT_S = 5.0


class AgentRunningError(SnapctlError):
    """Another agent already owns this state directory (its lock is held)."""

    exit_status = ExitStatus.CONFLICT


class ListenError(SnapctlError):
    """The agent cannot listen where it was asked to (the address is in use, not on this
    host, or a socket path too long)."""

    exit_status = ExitStatus.UNAVAILABLE


class TokenFileError(SnapctlError):
    """The TCP listener's token file is missing, empty, not root's (or the agent's user's), or
    open to other users."""

    exit_status = ExitStatus.USAGE


@dataclass(frozen=True)
class AgentOptions:
    socket: Path | None = None  # default STATE/agent.sock
    listen: tuple[str, int] | None = None  # TCP, with a bearer token from token_file
    token_file: Path | None = None
    metrics_listen: tuple[str, int] | None = None
    # Start the host's ksmd (where stopped), so copies of in-image images share their pages
    # (the command's default; an agent made in process leaves the host's settings alone).
    share_memory: bool = False


def read_token(path: Path) -> bytes:
    """The bearer token: the first line of a regular file owned by root or the agent's user
    that no one else may read or write (its owner and mode are those of the file read)."""
    try:
        # Non-blocking: a FIFO put there is refused below, not waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            info = os.fstat(fd)
            data = file.read() if stat.S_ISREG(info.st_mode) else b""
    except OSError as error:
        raise TokenFileError(f"cannot read the token file: {error.strerror}", path=path) from error
    if not stat.S_ISREG(info.st_mode):
        raise TokenFileError(f"the token file {path} is not a regular file", path=path)
    if info.st_uid not in (0, os.geteuid()):
        raise TokenFileError(
            f"the token file {path} is owned by uid {info.st_uid}, who can read or replace the "
            f"token: chown it to root (or uid {os.geteuid()}, the agent's) and chmod 600 it",
            path=path,
        )
    if info.st_mode & 0o077:
        raise TokenFileError(
            f"the token file {path} is open to other users (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): chmod 600 it", path=path,
        )  # fmt: skip
    lines = data.splitlines()
    token = lines[0].strip() if lines else b""
    if len(token) < 16:
        raise TokenFileError("the token file must hold a token of at least 16 characters",
                             path=path)  # fmt: skip
    if not all(0x20 <= byte <= 0x7E for byte in token):
        # Clients send a header's text as ASCII (or latin-1): a token of other bytes, or of
        # control characters, could never match what they send.
        raise TokenFileError("the token must be printable ASCII (make one with openssl rand "
                             "-hex 32)", path=path)  # fmt: skip
    return token


class Agent:
    """A running agent: its lock, spawner, pool, service and listeners."""

    def __init__(
        self,
        state: StateDir,
        options: AgentOptions,
        *,
        spawner_factory: Callable[[], Spawner] = Spawner.start,
        pool_factory: Callable[..., WarmPool] = WarmPool,
    ) -> None:
        self.state = state
        self.options = options
        self.socket_path = options.socket or state.root / SOCKET_NAME
        self._socket_made = False
        self._spawner_factory = spawner_factory
        self._pool_factory = pool_factory
        self._lock_fd: int | None = None
        self._servers: list[Any] = []
        self._threads: list[threading.Thread] = []
        self.spawner: Spawner | None = None
        self.pool: WarmPool | None = None
        self.metrics = AgentMetrics()
        self._router: Router | None = None

    def start(self) -> None:
        """Take the state directory, fork the spawner, adopt, listen. On failure, undo."""
        token = read_token(self.options.token_file) if self.options.token_file else None
        if self.options.listen is not None and token is None:
            raise TokenFileError("--listen needs --token-file (a TCP listener needs a token)")
        self.state.ensure()
        # Before any thread: the spawner forks every supervisor from here on. Before the lock
        # too: a child forked with the lock's descriptor would hold the lock after a killed
        # agent, for as long as any supervisor it forked lives.
        self.spawner = self._spawner_factory()
        try:
            self._lock()
        except BaseException:
            self.stop()
            raise
        try:
            self.pool = self._pool_factory(self.state, spawner=self.spawner, events=self.metrics)
            adoption = self.pool.adopt()
            if adoption.discarded or adoption.removed:
                log(f"discarded {len(adoption.discarded)} parked copies an earlier agent left; "
                    f"removed {len(adoption.removed)} leftovers")  # fmt: skip
            pool = self.pool
            self.metrics.watch_pool(lambda: _safe_listing(pool))
            state = self.state
            self.metrics.watch_activations(lambda: _safe_rows(state))
            if self.options.share_memory:
                _share_memory()
            service = AgentService(
                self.state, pool=self.pool, spawner=self.spawner, metrics=self.metrics
            )
            router = Router(service)
            self._router = router
            self._listen_unix(router)
            if self.options.listen is not None:
                handler = handler_for(router, token=token)
                self._serve(self._tcp(self.options.listen, handler, "api"), "api (tcp)")
            if self.options.metrics_listen is not None:
                handler = handler_for(router, metrics_only=True)
                self._serve(self._tcp(self.options.metrics_listen, handler, "metrics"), "metrics")
        except BaseException:
            self.stop()
            raise

    def _tcp(self, address: tuple[str, int], handler: Any, listener: str) -> TCPHTTPServer:
        refused = {
            limit: self.metrics.tcp_refused.labels(listener=listener, limit=limit)
            for limit in get_args(BusyLimit)
        }  # every series from 0, for rate() and alerts
        try:
            return TCPHTTPServer(address, handler, lambda limit: refused[limit].inc())
        except OSError as error:
            raise ListenError(
                f"cannot listen on {address[0]}:{address[1]}: {error.strerror or error}"
            ) from error

    def _lock(self) -> None:
        fd = try_lock(self.state.root / "agent.lock")
        if fd is None:
            raise AgentRunningError(
                f"another agent owns {self.state.root} (stop it first; its socket: "
                f"{self.socket_path})", path=self.state.root,
            )  # fmt: skip
        self._lock_fd = fd

    def _listen_unix(self, router: Router) -> None:
        # We hold the lock: a socket file left here is a dead agent's; anything else is not
        # ours to remove (--socket may name any path).
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(self.socket_path.lstat().st_mode):
                raise ListenError(
                    f"{self.socket_path} exists and is not a socket: give another --socket",
                    path=self.socket_path,
                )
            self.socket_path.unlink()
        self.socket_path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        root_only = frozenset({0, os.getuid()})
        try:
            server = UnixHTTPServer(
                str(self.socket_path), handler_for(router, allowed_uids=root_only)
            )
        except OSError as error:
            raise ListenError(f"cannot listen on {self.socket_path}: {error.strerror}",
                              path=self.socket_path) from error  # fmt: skip
        self._socket_made = True
        self._serve(server, "api")

    def _serve(self, server: Any, what: str) -> None:
        self._servers.append(server)
        thread = threading.Thread(target=server.serve_forever, name=f"agent-{what}", daemon=True)
        thread.start()
        self._threads.append(thread)
        address = server.server_address
        where = address if isinstance(address, str) else "{}:{}".format(*address[:2])
        log(f"{what} listening on {where}")

    @property
    def addresses(self) -> list[Any]:
        return [server.server_address for server in self._servers]

    def stop(self) -> None:
        """Close the listeners, discard parked copies, end the spawner, drop the lock.
        Copies already served keep running; ``logs -f`` streams are ended, not waited for."""
        if self._router is not None:
            self._router.stop_following()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._servers, self._threads = [], []
        if self._router is not None and not self._router.in_flight.wait_idle(IN_FLIGHT_WAIT_S):
            log(f"requests still running after {IN_FLIGHT_WAIT_S:.0f} s: stopping anyway (their "
                "copies keep serving; their clients get no report)")  # fmt: skip
        if self._router is not None:
            # Told to end when the stop began: each within a poll of its log.
            self._router.in_flight.wait_idle(FOLLOWERS_END_WAIT_S, followers=True)
        self._router = None
        with contextlib.suppress(FileNotFoundError):
            if self._socket_made:  # only the socket this agent made
                self.socket_path.unlink()
        self._socket_made = False
        if self.pool is not None:
            try:
                self.pool.close()
            except Exception as error:  # still end the spawner and drop the lock
                log(f"closing the pool failed: {error}")
            self.pool = None
        if self.spawner is not None:
            self.spawner.close()
            self.spawner = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _safe_listing(pool: WarmPool) -> Any:
    try:
        return pool.listing()
    except Exception:  # a scrape never fails for the pool's sake
        return None


def _safe_rows(state: StateDir) -> list[dict[str, Any]]:
    try:
        return activation_rows(state)
    except Exception:  # a scrape never fails for the activations' sake
        return []


def _share_memory() -> None:
    """Start ksmd where the host has it stopped; say so, or why it could not."""
    try:
        if enable_ksm():
            log("started the host's KSM: copies of in-image images share their unwritten pages")
    except OSError as error:
        log(f"cannot start the host's KSM ({error.strerror}): copies share no pages")


def run_agent(state: StateDir, options: AgentOptions) -> None:
    """Run an agent in the foreground until SIGTERM or SIGINT."""
    import logging
    import sys

    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("snapctl agent: %(message)s"))
    logger = logging.getLogger("snapctl.agent")
    logger.addHandler(to_stderr)
    logger.setLevel(logging.INFO)
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda signum, frame: stop.set())
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    agent = Agent(state, options)
    try:
        agent.start()
        log(f"serving {state.root} (pid {os.getpid()}); SIGTERM stops the agent, not the copies")
        while not stop.wait(3600):
            pass
        log("stopping: parked copies are discarded, served copies keep running")
    finally:
        agent.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
