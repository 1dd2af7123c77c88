"""``python -m snapctl.namespaces.readonly PID MOUNT_POINT...``: make those mounts of PID's
mount namespace read-only, each one's other attributes as they are.

A process of its own: a process joins another mount namespace only while it has one thread,
which snapctl's never has. It resolves nothing through that namespace's files (no program is
run there, which need not exist in it): it joins, then asks the kernel directly.
"""

from __future__ import annotations

import sys

from snapctl.namespaces import mounts


def main(argv: list[str]) -> int:
    pid, points = argv[0], argv[1:]
    mounts.join_mount_namespace(pid)
    for point in points:
        mounts.make_read_only(point)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except OSError as error:
        print(f"snapctl: {error}", file=sys.stderr)
        sys.exit(1)
