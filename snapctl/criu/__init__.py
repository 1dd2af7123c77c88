"""Running CRIU: finding a usable binary, reproducible invocations, errors and statistics.

Everything that executes ``criu`` goes through :func:`run_criu`, which always passes
``--images-dir``, ``--log-file`` and a log level (``-v4``; dumps ``-v3``, which run while the
tree is frozen), writes the exact argv beside the log, and raises
:class:`CriuError` with the log tail when CRIU fails.
"""

from snapctl.criu.locate import CriuBinary, find_criu
from snapctl.criu.run import CriuError, CriuResult, run_criu
from snapctl.criu.stats import DumpStats, RestoreStats, read_dump_stats, read_restore_stats

__all__ = [
    "CriuBinary",
    "CriuError",
    "CriuResult",
    "DumpStats",
    "RestoreStats",
    "find_criu",
    "read_dump_stats",
    "read_restore_stats",
    "run_criu",
]
