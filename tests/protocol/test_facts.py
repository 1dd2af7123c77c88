"""The capture facts: strictly read, bounded, never through a symlink, consistent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapctl.errors import ProtocolError
from snapctl.protocol.facts import MAX_FACTS_BYTES, CaptureFacts, read_facts, write_facts

DIGEST = "0" * 64


def test_facts_written_are_read_back(tmp_path: Path) -> None:
    facts = CaptureFacts(
        memory_policy="reload", reload_digests=True, parameter_digests={"w": DIGEST}
    )
    write_facts(tmp_path / "facts.json", facts)
    assert read_facts(tmp_path / "facts.json") == facts
    assert read_facts(tmp_path / "absent.json") is None  # a server that stated nothing


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ('{"memory_policy": "lazy"}', "memory_policy"),
        ('{"memory_policy": "in-image", "reload_digests": true}', "needs the reload policy"),
        ('{"memory_policy": "in-image", "parameter_digests": {"w": "xyz"}}', "parameter_digests"),
        ('{"memory_policy": "in-image", "extra": 1}', "extra"),
    ],
)
def test_a_bad_facts_file_is_refused_naming_the_field(
    tmp_path: Path, payload: str, says: str
) -> None:
    path = tmp_path / "facts.json"
    path.write_text(payload)
    with pytest.raises(ProtocolError, match=says):
        read_facts(path)


def test_a_symlinked_or_oversized_facts_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target.json"
    target.write_text('{"memory_policy": "in-image"}')
    link = tmp_path / "facts.json"
    os.symlink(target, link)
    with pytest.raises(ProtocolError, match="regular file"):
        read_facts(link)
    big = tmp_path / "big.json"
    big.write_text(" " * (MAX_FACTS_BYTES + 1))
    with pytest.raises(ProtocolError, match="larger than"):
        read_facts(big)
