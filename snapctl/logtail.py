"""The end of a log, as errors carry it (``SnapctlError.log_tail``): the one place that cuts one.

A tail is counted in lines and capped in characters, so a log of very long lines (a JSON dump,
a progress bar without newlines) still gives a tail a terminal can show. CRIU's logs put the
line that explains a failure well before the end; ``keep_errors`` puts such lines first.
Imports only the standard library: every package may use it.
"""

from __future__ import annotations

from pathlib import Path

LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 4000


def log_tail(
    path: Path,
    lines: int = LOG_TAIL_LINES,
    *,
    max_chars: int = LOG_TAIL_CHARS,
    keep_errors: int = 0,
) -> str:
    """The last ``lines`` lines of the log at ``path`` (empty if it cannot be read), at most
    ``max_chars`` characters; see :func:`text_tail` for ``keep_errors``."""
    try:
        with path.open("rb") as log:
            if not keep_errors:
                # Only the end is needed: a UTF-8 character is at most 4 bytes.
                size = log.seek(0, 2)
                log.seek(max(0, size - 4 * max_chars))
                if log.tell():
                    log.readline()  # the first line read is cut: drop it
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    return text_tail(text, lines, max_chars=max_chars, keep_errors=keep_errors)


def text_tail(
    text: str,
    lines: int = LOG_TAIL_LINES,
    *,
    max_chars: int = LOG_TAIL_CHARS,
    keep_errors: int = 0,
) -> str:
    """The last ``lines`` lines of ``text``, at most ``max_chars`` characters (whole lines,
    except a last line longer than that, cut to its end).

    With ``keep_errors``, up to that many earlier lines that mention an error come first (they
    get at most half of ``max_chars``), so the line that explains a failure survives a log
    that went on after it.
    """
    if lines < 1 or max_chars < 1:
        raise ValueError("lines and max_chars must be positive")
    all_lines = text.splitlines()
    tail = all_lines[-lines:]
    earlier = all_lines[: len(all_lines) - len(tail)]
    errors = (
        [line for line in earlier if "error" in line.lower()][-keep_errors:] if keep_errors else []
    )
    errors = _fit(errors, max_chars // 2, cut=False)
    used = sum(len(line) + 1 for line in errors)
    return "\n".join([*errors, *_fit(tail, max_chars - used, cut=True)])


def _fit(lines: list[str], budget: int, *, cut: bool) -> list[str]:
    """The last of ``lines`` whose characters (newlines counted) fit in ``budget``; with
    ``cut``, a last line too long for it alone is cut to its end rather than dropped."""
    kept: list[str] = []
    for line in reversed(lines):
        if len(line) + 1 > budget:
            if cut and not kept and budget > 0:
                kept.append(line[-budget:])
            break
        kept.append(line)
        budget -= len(line) + 1
    return kept[::-1]
