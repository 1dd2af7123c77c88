"""The served workload: the bundled fixture model, its cold start, and "first correct
completion" (a greedy completion whose token ids equal the reference), reached either on a host
port or from inside a restored tree's network namespace."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapctl.activation.launch import LaunchOptions, fixture_command, repo_root
from snapctl.statedir import StateDir

PROMPT = "The capital of"
MAX_TOKENS = 8
PARAMS_MB = 4
KV_MB = 8
POLL_S = 0.002
CLONE_NEWNET = 0x40000000

Connect = Callable[[], http.client.HTTPConnection]


class WorkloadError(RuntimeError):
    """The server answered wrongly, died, or never answered in time."""


@dataclass(frozen=True)
class Answer:
    """What a completion returned: enough to say whether it is the correct one."""

    text: str
    token_ids: list[int]


def launch_options(retained_mb: int, timeout_s: float = 300.0) -> LaunchOptions:
    """The fixture as every contender runs it (only the retained memory varies)."""
    return LaunchOptions(
        fixture_params_mb=PARAMS_MB,
        fixture_retained_mb=retained_mb,
        fixture_kv_mb=KV_MB,
        timeout_s=timeout_s,
        server_timeout_s=timeout_s,
    )


def complete(
    connection: http.client.HTTPConnection,
    model: str = "snapctl-fixture",
    extra: dict[str, Any] | None = None,
) -> Answer:
    """One greedy completion; raises OSError/HTTPException while the server is not up.
    ``extra`` adds request fields (vLLM needs ``return_token_ids``)."""
    request = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    body = json.dumps(request | (extra or {}))
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise WorkloadError(f"completion answered HTTP {response.status}: {payload[:200]!r}")
    choice: dict[str, Any] = json.loads(payload)["choices"][0]
    return Answer(text=choice["text"], token_ids=list(choice["token_ids"]))


def first_correct(
    connect: Connect,
    reference: Answer | None,
    timeout_s: float,
    alive: Callable[[], bool] = lambda: True,
    ask: Callable[[http.client.HTTPConnection], Answer] = complete,
) -> Answer:
    """Poll until a completion (``ask``) answers, then require it to equal ``reference``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            answer = ask(connect())
        except (OSError, http.client.HTTPException) as error:
            last = f"{type(error).__name__}: {error}"
            if not alive():
                raise WorkloadError(f"server exited before answering ({last})") from error
            time.sleep(POLL_S)
            continue
        if reference is not None and answer != reference:
            raise WorkloadError(f"wrong completion: {answer} (expected {reference})")
        return answer
    raise WorkloadError(f"no completion within {timeout_s:g} s ({last})")


def host_connect(port: int, host: str = "127.0.0.1") -> Connect:
    return lambda: http.client.HTTPConnection(host, port, timeout=30)


def in_netns(pid: int, work: Callable[[], Answer]) -> Answer:
    """Run ``work`` in a thread that entered the network namespace of ``pid`` (sockets it
    opens live there); the thread ends with ``work``, so nothing keeps the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    outcome: list[Answer | BaseException] = []

    def run() -> None:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the copy's netns")
        except BaseException as error:
            outcome.append(error)
            return
        finally:
            os.close(fd)
        try:
            outcome.append(work())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run, name=f"bench-netns-{pid}", daemon=True)
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ColdServer:
    """An ordinary start of the fixture server on the host (no ``--snapshot-config``)."""

    def __init__(self, state: StateDir, retained_mb: int, log_path: Path) -> None:
        argv, cwd = fixture_command(launch_options(retained_mb), state)
        self.port = free_port()
        argv[argv.index("--port") + 1] = str(self.port)
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env={**os.environ, "PYTHONPATH": str(repo_root())}, start_new_session=True,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def ensure_model(state: StateDir) -> None:
    """Build the fixture model once, outside every timed span."""
    state.ensure()
    fixture_command(launch_options(0), state)
