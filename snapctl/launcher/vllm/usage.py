"""What startup capture accepts of ``vllm serve``'s command line, and the error that says
what it does not (used by the command line's parser and by the server alike)."""

from __future__ import annotations

from argparse import Namespace

from snapctl.errors import ExitStatus, SnapctlError


class UsageError(SnapctlError, ValueError):
    """The command line cannot be run (the message names the fix)."""

    exit_status = ExitStatus.USAGE


def require_single_frontend(args: Namespace) -> None:
    """Startup capture needs one Python HTTP frontend on one local rank (as #59851 checks)."""
    if args.headless or getattr(args, "grpc", False) or args.uds:
        raise UsageError("startup capture requires one HTTP frontend (no --headless/--grpc/--uds)")
    if getattr(args, "api_server_count", None) not in (None, 1):
        raise UsageError("startup capture requires --api-server-count 1")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(args, name, 1) != 1:
            raise UsageError(f"startup capture requires {name}=1")
