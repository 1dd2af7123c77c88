"""Run by tests/pool/test_spawner.py in a fresh interpreter (no thread yet): start a spawner
whose jobs describe the supervisor they run in, spawn two, print what they said and the
spawner's PID, then close the spawner."""

from __future__ import annotations

import json
import os
import sys

from snapctl.pool.spawner import Spawner


def describe(job: dict[str, object], fd: int) -> None:
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({
            "job": job, "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
            "stdin": os.readlink("/proc/self/fd/0"),
        }) + "\n")  # fmt: skip


def main() -> None:
    spawner = Spawner.start(describe)
    said = []
    for index in range(2):
        with os.fdopen(spawner.spawn({"index": index}), "rb") as reader:
            said.append(json.loads(reader.readline()))
    print(json.dumps({"spawner": spawner.pid, "said": said}))
    sys.stdout.flush()
    spawner.close()


if __name__ == "__main__":
    main()
