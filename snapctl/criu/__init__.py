"""Running CRIU: finding a usable binary, reproducible invocations, errors and statistics.

Everything that executes ``criu`` goes through :func:`run_criu`, which always passes
``--images-dir``, ``--log-file`` and a log level (``-v4``; dumps ``-v3``, which run while the
tree is frozen), writes the exact argv beside the log, and raises
:class:`CriuError` with the log tail when CRIU fails.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from snapctl.criu.locate import CriuBinary, find_criu
    from snapctl.criu.run import CriuError, CriuResult, run_criu
    from snapctl.criu.stats import DumpStats, RestoreStats, read_dump_stats, read_restore_stats

# Loaded on first use, so that a light submodule (the lazy tuning constants, which ``--help``
# reads) does not import the runner, its models and psutil.
_HOMES = {
    "CriuBinary": "locate",
    "find_criu": "locate",
    "CriuError": "run",
    "CriuResult": "run",
    "run_criu": "run",
    "DumpStats": "stats",
    "RestoreStats": "stats",
    "read_dump_stats": "stats",
    "read_restore_stats": "stats",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


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
