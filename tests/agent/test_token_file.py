"""The TCP listener's token file: only a regular file of root's (or the agent's user's) that no
one else may read or write holds the token; anything else is refused, naming the file and
the fix, before the agent starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapctl.agent.daemon import Agent, AgentOptions, TokenFileError, read_token
from snapctl.statedir import StateDir
from tests.agent.conftest import FakePool, FakeSpawner

TOKEN = "t" * 32


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def test_a_token_file_of_root_s_or_the_agent_s_user_only_serves(token: Path) -> None:
    assert token.stat().st_uid == os.geteuid()
    assert read_token(token) == TOKEN.encode()
    token.chmod(0o400)
    assert read_token(token) == TOKEN.encode()


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the file away: needs root")
def test_a_token_file_another_user_owns_is_refused(token: Path, tmp_path: Path) -> None:
    os.chown(token, 65534, 65534)  # mode 0600 still: only its owner, nobody, reads it
    with pytest.raises(TokenFileError) as refused:
        read_token(token)
    message = refused.value.message
    assert str(token) in message and "uid 65534" in message and "chown" in message
    assert refused.value.path == token
    options = AgentOptions(socket=tmp_path / "agent.sock", listen=("127.0.0.1", 0),
                           token_file=token)  # fmt: skip
    agent = Agent(StateDir(tmp_path / "state"), options,
                  spawner_factory=FakeSpawner, pool_factory=FakePool)  # type: ignore[arg-type]  # fmt: skip
    try:
        with pytest.raises(TokenFileError, match="owned by uid 65534"):
            agent.start()
        assert not (tmp_path / "agent.sock").exists()
    finally:
        agent.stop()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o610, 0o660], ids=oct)
def test_a_token_file_open_to_group_or_others_is_refused(token: Path, mode: int) -> None:
    token.chmod(mode)
    with pytest.raises(TokenFileError) as refused:
        read_token(token)
    message = refused.value.message
    assert str(token) in message and f"{mode:04o}" in message and "chmod 600" in message


def test_a_token_file_that_is_not_a_regular_file_is_refused_without_waiting(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)  # opening it to read would wait for a writer
    with pytest.raises(TokenFileError, match="not a regular file"):
        read_token(fifo)


def test_a_missing_token_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read the token file"):
        read_token(tmp_path / "absent")
