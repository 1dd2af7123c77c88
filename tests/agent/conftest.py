"""An agent on a socket in tmp_path, with a fake spawner and pool (no root, no CRIU): what the
agent's own code does (routing, validation, streaming, the CLI through it) is real."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from snapctl.activation.requests import CopyRequest
from snapctl.agent.daemon import Agent, AgentOptions
from snapctl.pool import (
    AdoptionReport,
    ParkedHandle,
    PoolEntry,
    PoolEvents,
    PoolListing,
    PoolTarget,
)
from snapctl.pool.spawner import SpawnedJob
from snapctl.statedir import StateDir


def make_report(**changes: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "name": "copy-1", "kind": "copy", "image": "/images/one", "image_id": "sha256:abc",
        "activation_id": "copy-0123456789ab", "root_pid": 4242, "pids": [4242],
        "host": "127.0.0.1", "port": 8000, "published": None, "logs": "/logs/copy-1",
        "timings_s": {"verify": 0.001, "restore": 0.05, "activate": 0.02},
        "image_bytes": None, "dump_stats": None, "restore_stats": {"pages_restored": 1},
        "handshake_phases": ["activation", "release"], "lazy": False, "lazy_pages_pid": None,
        "pages_complete": None, "pages_complete_s": None, "pages_complete_at": None,
        "from_pool": False,
    }  # fmt: skip
    report.update(changes)
    return report


@dataclass
class FakeSpawner:
    """Answers each job at once with ``script``'s messages (progress, then the outcome)."""

    jobs: list[dict[str, Any]] = field(default_factory=list)
    script: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {"lane": "", "progress": "restoring with CRIU"},
            {"report": make_report()},
        ]
    )
    closed: bool = False
    pid: int = 0
    # Seconds before the last message (the outcome): a start that takes a while.
    delay_s: float = 0.0
    # Set: the outcome waits for it instead (a minute at most), so a test decides when a
    # start ends rather than racing a delay.
    release: threading.Event | None = None

    def spawn(self, job: dict[str, Any]) -> int:
        self.jobs.append(job)
        read_fd, write_fd = os.pipe()
        writer = os.fdopen(write_fd, "w")
        for message in self.script[:-1]:
            writer.write(json.dumps(message) + "\n")
        writer.flush()

        def finish() -> None:
            if self.release is not None:
                self.release.wait(60)
            time.sleep(self.delay_s)
            with writer:
                writer.write(json.dumps(self.script[-1]) + "\n")

        threading.Thread(target=finish, daemon=True).start()
        return read_fd

    def launch(self, job: dict[str, Any]) -> SpawnedJob:
        return SpawnedJob(self.spawn(job), None)  # no process to pin: nothing to cancel

    def close(self) -> None:
        self.closed = True


class FakePool:
    def __init__(self, state: StateDir, *, spawner: Any, events: PoolEvents | None = None) -> None:
        self.state = state
        self.events = events
        self.targets: dict[str, PoolTarget] = {}
        self.ready: list[ParkedHandle] = []
        self.taken_for: list[CopyRequest | None] = []
        self.forgotten: list[ParkedHandle] = []
        self.settled_handles: list[ParkedHandle] = []
        self.closed = False

    def set(self, image: Path, size: int, *, lazy: bool | None = None,
            max_memory: int | None = None, memory_bytes: int | None = None,
            cpus: float | None = None) -> PoolTarget:  # fmt: skip
        target = PoolTarget(image=str(image), size=size, lazy=lazy, max_memory=max_memory,
                            memory_bytes=memory_bytes, cpus=cpus)  # fmt: skip
        self.targets[str(image)] = target
        return target

    def remove(self, image: Path) -> PoolTarget:
        return self.targets.pop(str(image))

    def listing(self) -> PoolListing:
        entries = tuple(
            PoolEntry(target=target, image_id=None, memory_bytes=0, parked=())
            for target in self.targets.values()
        )
        return PoolListing(entries=entries, memory_bytes=0)

    def take(self, image: Path, request: CopyRequest | None = None) -> ParkedHandle | None:
        self.taken_for.append(request)
        return self.ready.pop() if self.ready else None

    def forget(self, handle: ParkedHandle) -> None:
        self.forgotten.append(handle)

    def settled(self, handle: ParkedHandle) -> None:
        self.settled_handles.append(handle)

    def adopt(self) -> AdoptionReport:
        return AdoptionReport(discarded=(), removed=())

    def close(self) -> None:
        self.closed = True


@dataclass
class RunningAgent:
    agent: Agent
    socket: Path
    state: StateDir
    spawner: FakeSpawner

    @property
    def pool(self) -> FakePool:
        pool = self.agent.pool
        assert isinstance(pool, FakePool)
        return pool


@pytest.fixture
def running_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningAgent]:
    state = StateDir(tmp_path / "state")
    socket_path = tmp_path / "state" / "agent.sock"
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(state.root))
    monkeypatch.delenv("SNAPCTL_AGENT_SOCKET", raising=False)
    monkeypatch.delenv("SNAPCTL_NO_AGENT", raising=False)
    spawner = FakeSpawner()
    agent = Agent(
        state, AgentOptions(socket=socket_path), spawner_factory=lambda: spawner,  # type: ignore[arg-type,return-value]
        pool_factory=FakePool,
    )  # fmt: skip
    agent.start()
    try:
        yield RunningAgent(agent, socket_path, state, spawner)
    finally:
        agent.stop()
