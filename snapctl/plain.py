"""Output for the CLI's light paths (``ps``, ``stop``, and every command through the agent):
JSON records and tables drawn with the standard library only. It lives outside
:mod:`snapctl.cli`, whose package imports click: :mod:`snapctl.entry` answers ``ps`` before
click is imported.

``snapctl ps`` through the agent must finish in tens of milliseconds, which leaves no room for
importing rich or pydantic; so the commands whose output this module draws draw it this way in
process too, and the output is the same either way. The tables use rich's default look (heavy
head, light body) so they sit with the other commands' tables.
"""

from __future__ import annotations

import sys

from snapctl import wire

TYPE_CHECKING = False  # not typing's: see snapctl.errors
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any


def emit_json(record: Any, *, sort_keys: bool = True) -> None:
    """Exactly one JSON record on one line of stdout, formatted as
    :func:`snapctl.cli.output.emit_json` formats it (``sort_keys=False``: as pydantic's
    ``model_dump_json`` does, in field order)."""
    # json.dumps escapes what is not ASCII, pydantic does not.
    text = wire.dumps(record, sort_keys=sort_keys, ensure_ascii=sort_keys)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def mib(value: int) -> str:
    """A byte count as the pool shows memory: whole MiB, or bytes below one."""
    return f"{value / (1 << 20):.0f} MiB" if value >= 1 << 20 else f"{value} bytes"


def _width(text: str) -> int:
    import unicodedata  # for tables only, not for a copy's JSON record

    return sum(2 if unicodedata.east_asian_width(char) in "WF" else 1 for char in text)


def _pad(text: str, width: int) -> str:
    return text + " " * (width - _width(text))


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
          show_header: bool = True) -> str:  # fmt: skip
    """A table with one-space padding, ``title`` centred above it."""
    widths = [_width(column) if show_header else 0 for column in columns]
    for row in rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], _width(cell))
    spans = [width + 2 for width in widths]
    lines = []
    total = sum(spans) + len(spans) + 1
    if title:
        lines.append(title.center(total).rstrip())
    if show_header:
        lines.append("┏" + "┳".join("━" * span for span in spans) + "┓")
        lines.append(
            "┃" + "┃".join(f" {_pad(c, w)} " for c, w in zip(columns, widths, strict=True)) + "┃"
        )
        lines.append("┡" + "╇".join("━" * span for span in spans) + "┩")
    else:
        lines.append("┌" + "┬".join("─" * span for span in spans) + "┐")
    for row in rows:
        lines.append(
            "│" + "│".join(f" {_pad(c, w)} " for c, w in zip(row, widths, strict=True)) + "│"
        )
    lines.append("└" + "┴".join("─" * span for span in spans) + "┘")
    return "\n".join(lines)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *,
                title: str | None = None) -> None:  # fmt: skip
    sys.stdout.write(table(columns, rows, title=title) + "\n")
    sys.stdout.flush()


def describe_audit(audit: dict[str, Any]) -> str:
    """:meth:`snapctl.activation.session.CleanupAudit.describe` of an audit as JSON."""
    parts = [f"{key}: {value}" for key, value in audit.items() if value]
    return "; ".join(parts) or "clean"


def audit_clean(audit: dict[str, Any]) -> bool:
    return not any(audit.values())


def ps_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """``snapctl ps``'s table rows from its JSON rows (in-process or the agent's)."""
    table_rows = []
    for row in rows:
        running = "yes" if row["running"] else "no"
        if row["running"] and not row["supervised"]:
            running = "yes, unsupervised (snapctl gc)"
        table_rows.append([
            row["name"], row["kind"], str(row["root_pid"]), str(row["port"]),
            row["published"] or "-", running, _pages(row), _memory(row), row["image"] or "-",
        ])  # fmt: skip
    return table_rows


PS_COLUMNS = (
    "name", "kind", "root pid", "port", "published", "running", "pages", "memory", "image",
)  # fmt: skip


def _memory(row: dict[str, Any]) -> str:
    """The tree's PSS, and what KSM saves in it where it saves anything (rows from an agent
    older than these fields have none)."""
    value = row.get("memory_bytes")
    if value is None:
        return "-"
    saved = row.get("ksm_saved_bytes")
    return mib(value) if not saved or saved <= 0 else f"{mib(value)} (KSM saves {mib(saved)})"


def _pages(row: dict[str, Any]) -> str:
    """A lazy copy's memory: "transferring", or complete and how long after its restore."""
    if row["pages_complete"] is None:
        return "-"
    if not row["pages_complete"]:
        return "transferring"
    return f"complete ({row['pages_complete_s']:.2f} s)"
