"""The progress callbacks long operations take: one step line, or a count of bytes done."""

from __future__ import annotations

from collections.abc import Callable

# Called with one line naming the step just started (the CLI shows it, --json drops it).
Progress = Callable[[str], None]
# Called with the bytes done since its last call (archives, registry transfers).
ByteProgress = Callable[[int], None]
