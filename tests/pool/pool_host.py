"""A stand-in for the agent in the pool's real tests: forks the spawner first (no thread
yet), then runs a WarmPool and takes one JSON command a line on stdin, answering one JSON
line on stdout. Killing this process is what "the agent was killed" means in the tests.

Commands: {"op": "adopt"}, {"op": "set", "image", "size", "lazy"?, "max_memory"?},
{"op": "rm", "image"}, {"op": "ls"}, {"op": "copy", "request"} (from the pool when one is
ready, else a fresh supervisor), {"op": "fresh", "request"}, {"op": "take", "request"} (a
parked copy's id, or None), {"op": "activate", "id", "request"}, {"op": "events"},
{"op": "close"}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from snapctl.activation.requests import CopyRequest
from snapctl.pool import Spawner, WarmPool, activate_taken, copy_via_supervisor
from snapctl.pool.serve import activate_from_pool
from snapctl.pool.wire import ParkedHandle
from snapctl.statedir import StateDir


class Events:
    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def parked(self, image: str, seconds: float) -> None:
        self.seen.append(["parked", image, seconds])

    def taken(self, image: str) -> None:
        self.seen.append(["taken", image])

    def discarded(self, image: str, reason: str) -> None:
        self.seen.append(["discarded", image, reason])

    def failed(self, image: str, phase: str) -> None:
        self.seen.append(["failed", image, phase])


def main() -> None:
    spawner = Spawner.start()  # before any thread
    state = StateDir()
    events = Events()
    pool = WarmPool(state, spawner=spawner, events=events)

    taken: dict[str, ParkedHandle] = {}

    def progress(lane: str, step: str) -> None:
        pass

    def serve(command: dict[str, Any]) -> Any:
        op = command["op"]
        if op == "adopt":
            return pool.adopt().model_dump(mode="json")
        if op == "set":
            target = pool.set(Path(command["image"]), command["size"], lazy=command.get("lazy"),
                              max_memory=command.get("max_memory"))  # fmt: skip
            return target.model_dump(mode="json")
        if op == "rm":
            return pool.remove(Path(command["image"])).model_dump(mode="json")
        if op == "ls":
            return pool.listing().model_dump(mode="json")
        if op == "events":
            return events.seen
        if op in ("copy", "fresh"):
            request = CopyRequest.model_validate_json(json.dumps(command["request"]))
            started = time.monotonic()
            report = activate_from_pool(pool, request, progress) if op == "copy" else None
            if report is None:
                report = copy_via_supervisor(request, state, progress, spawner=spawner)
            return {"report": report, "wall_s": time.monotonic() - started}
        if op == "take":
            request = CopyRequest.model_validate_json(json.dumps(command["request"]))
            handle = pool.take(Path(request.image), request)
            if handle is None:
                return None
            taken[handle.id] = handle
            return handle.id
        if op == "activate":
            request = CopyRequest.model_validate_json(json.dumps(command["request"]))
            handle = taken.pop(command["id"])
            try:
                return activate_taken(handle, request, progress)
            finally:
                pool.settled(handle)
        if op == "close":
            pool.close()
            spawner.close()
            return "closed"
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        command = json.loads(line)
        try:
            answer = {"ok": serve(command)}
        except Exception as error:
            answer = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
        if command["op"] == "close":
            return


if __name__ == "__main__":
    main()
