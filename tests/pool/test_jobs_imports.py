"""A supervisor forked by the spawner imports nothing more when it checks and starts its job:
the spawner imported it all before forking (an import there is tens of milliseconds of every
copy, on the path a pooled copy is meant to serve in)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.images.factories import publish_sample

PROBE = """
import sys
import snapctl.pool.supervisor.jobs as jobs
from snapctl.activation.requests import CopyRequest
before = set(sys.modules)
request = CopyRequest(image=sys.argv[1], name="probe", publish={"address": "127.0.0.1", "port": 0})
jobs.check_request(request)
jobs.launch_options(request)
print(sorted(set(sys.modules) - before))
"""


def test_checking_a_copy_request_imports_nothing_more(tmp_path: Path) -> None:
    image = tmp_path / "image"
    publish_sample(image)
    done = subprocess.run([sys.executable, "-c", PROBE, str(image)], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]", done.stdout
