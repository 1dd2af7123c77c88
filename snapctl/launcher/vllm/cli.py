"""``python -m snapctl.launcher.vllm serve MODEL [options] [--snapshot-config JSON]``, and
``python -m snapctl.launcher.vllm reference-digests MODEL`` (see :mod:`.reference`).

The options are ``vllm serve``'s, parsed by vLLM's own parser; ``--snapshot-config`` (which
released vLLM does not know) and the bridge's own ``--snapctl-memory-policy
{auto,in-image,reload}`` and ``--snapctl-reload-digests`` are taken out first. The worker
extension that computes digests is added, since the debug routes need it in both modes.
"""

from __future__ import annotations

import sys
from argparse import Namespace

from snapctl.launcher.vllm.memory import MemoryOptions, split_memory_options
from snapctl.launcher.vllm.usage import UsageError
from snapctl.launcher.vllm.worker import EXTENSION

SNAPSHOT_FLAG = "--snapshot-config"
EXTENSION_FLAG = "--worker-extension-cls"


def split_snapshot_config(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--snapshot-config VALUE`` (or ``=VALUE``), and that value."""
    rest: list[str] = []
    value: str | None = None
    iterator = iter(argv)
    for arg in iterator:
        if arg == SNAPSHOT_FLAG:
            value = next(iterator, None)
            if value is None:
                raise UsageError(f"{SNAPSHOT_FLAG} needs a JSON value")
        elif arg.startswith(SNAPSHOT_FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return rest, value


def with_worker_extension(argv: list[str]) -> list[str]:
    given = [a for a in argv if a == EXTENSION_FLAG or a.startswith(EXTENSION_FLAG + "=")]
    if not given:
        return [*argv, EXTENSION_FLAG, EXTENSION]
    if f"{EXTENSION_FLAG}={EXTENSION}" in argv or EXTENSION in argv:
        return argv
    raise UsageError(
        f"{EXTENSION_FLAG} is taken by snapctl's digest extension ({EXTENSION}); "
        "drop yours or make it a subclass and name that"
    )


def parse(argv: list[str]) -> tuple[Namespace, str | None, MemoryOptions]:
    """vLLM's serve arguments, the raw ``--snapshot-config`` value and the memory options."""
    if not argv or argv[0] != "serve":
        raise UsageError("usage: python -m snapctl.launcher.vllm serve MODEL [vllm serve options]")
    rest, snapshot_config = split_snapshot_config(argv[1:])
    rest, memory = split_memory_options(rest)
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m snapctl.launcher.vllm serve"))
    args = parser.parse_args(with_worker_extension(rest))
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag  # as `vllm serve MODEL` does
    validate_parsed_serve_args(args)
    return args, snapshot_config, memory


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reference-digests"] and len(argv) == 2:
        import json
        from pathlib import Path

        from snapctl.launcher.vllm.reference import reference_digests

        print(json.dumps(reference_digests(Path(argv[1]))))
        return 0
    from snapctl.launcher.vllm.serve import run

    try:
        args, snapshot_config, memory = parse(argv)
    except UsageError as error:
        print(f"snapctl.launcher.vllm: {error}", file=sys.stderr)
        return 2
    return run(args, snapshot_config, memory)
