"""The bridge's own memory options (``--snapctl-memory-policy``, ``--snapctl-reload-digests``),
taken out of ``vllm serve``'s before vLLM parses them, and what they choose."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from snapctl.launcher.vllm.usage import UsageError
from snapctl.protocol.facts import MEMORY_POLICIES, MemoryPolicy

POLICY_FLAG = "--snapctl-memory-policy"
RELOAD_DIGESTS_FLAG = "--snapctl-reload-digests"
AUTO = "auto"


@dataclass(frozen=True)
class MemoryOptions:
    """The bridge's memory policy (None: chosen by the platform) and the reload's digests."""

    policy: MemoryPolicy | None = None
    reload_digests: bool = False


def split_memory_options(argv: list[str]) -> tuple[list[str], MemoryOptions]:
    """``argv`` without the bridge's memory options, and those options."""
    rest: list[str] = []
    policy: str = AUTO
    reload_digests = False
    iterator = iter(argv)
    for arg in iterator:
        if arg == POLICY_FLAG:
            policy = next(iterator, "")
        elif arg.startswith(POLICY_FLAG + "="):
            policy = arg.split("=", 1)[1]
        elif arg == RELOAD_DIGESTS_FLAG:
            reload_digests = True
        else:
            rest.append(arg)
    choices = (AUTO, *MEMORY_POLICIES)
    if policy not in choices:
        raise UsageError(f"{POLICY_FLAG} must be one of {', '.join(choices)}, got {policy!r}")
    chosen = None if policy == AUTO else cast(MemoryPolicy, policy)
    if reload_digests and chosen == "in-image":
        raise UsageError(f"{RELOAD_DIGESTS_FLAG} needs the reload policy: in-image reloads nothing")
    return rest, MemoryOptions(chosen, reload_digests)
