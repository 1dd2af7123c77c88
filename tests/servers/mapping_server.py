"""A minimal startup-capture server for identity tests: ``mapping_server.py FILE
--snapshot-config JSON`` maps FILE read-only, keeps it mapped across capture (as a server keeps
a library or a model mapped), and after ``validated`` answers every GET with 200.

Its canary reports FILE's first byte, so a copy restored over a changed FILE would notice only
if the identity gate had not refused it first.
"""

from __future__ import annotations

import mmap
import sys

from capture_stub import StubHooks, capture_then_serve, exit_on_sigterm


def main() -> None:
    exit_on_sigterm()
    path, flag, raw_config = sys.argv[1:4]
    assert flag == "--snapshot-config"
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    capture_then_serve(raw_config, StubHooks(text="m", token_ids=lambda: [mapped[0]]))


if __name__ == "__main__":
    main()
