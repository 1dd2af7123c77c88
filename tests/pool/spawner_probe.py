"""Run by tests/pool/test_spawner.py in a fresh interpreter (no thread yet): start a spawner
whose jobs describe the supervisor they run in, spawn two, print what they said and the
spawner's PID; launch a third that waits, and end it through the pidfd that pins it; then
close the spawner."""

from __future__ import annotations

import json
import os
import signal
import sys

from snapctl.pool.spawner import Spawner


def describe(job: dict[str, object], fd: int) -> None:
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({
            "job": job, "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
            "stdin": os.readlink("/proc/self/fd/0"),
        }) + "\n")  # fmt: skip
    if job.get("wait"):
        signal.pause()  # until its SIGTERM


def main() -> None:
    spawner = Spawner.start(describe)
    said = []
    for index in range(2):
        with os.fdopen(spawner.spawn({"index": index}), "rb") as reader:
            said.append(json.loads(reader.readline()))
    spawned = spawner.launch({"index": 2, "wait": True})
    assert spawned.pidfd is not None
    with os.fdopen(spawned.read_fd, "rb") as reader:
        waiting = json.loads(reader.readline())
        with open(f"/proc/self/fdinfo/{spawned.pidfd}") as info:
            pinned = next(int(line.split()[1]) for line in info if line.startswith("Pid:"))
        signal.pidfd_send_signal(spawned.pidfd, signal.SIGTERM)
        ended = reader.read() == b""  # its end of the pipe closed: it exited
    os.close(spawned.pidfd)
    print(json.dumps({"spawner": spawner.pid, "said": said, "pinned": pinned == waiting["pid"],
                      "ended": ended}))  # fmt: skip
    sys.stdout.flush()
    spawner.close()


if __name__ == "__main__":
    main()
