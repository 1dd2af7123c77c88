"""What a copy refuses before anything starts: one order and one message, whoever asks (the
in-process CLI, the agent before it takes a parked copy, a copy's supervisor), and the lazy
default's note said once, the same way in-process and through the agent."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapctl.activation.precheck import CopyUsageError, check_copy_start, decide_lazy, lazy_help
from snapctl.activation.requests import CopyRequest
from snapctl.agent.service import AgentService, BadRequestError
from snapctl.cli import main
from snapctl.criu.lazy.pagemap import PAGE_SIZE
from snapctl.criu.lazy.tuning import LAZY_DEFAULT_MIN_BYTES
from snapctl.criu.stats import DumpStats
from snapctl.errors import ExitStatus, SnapctlError
from snapctl.pool.supervisor.common import check_request
from snapctl.statedir import StateDir
from snapctl.statedir.names import NameInUseError
from tests.images.factories import publish_sample

pytestmark = pytest.mark.timeout(60)

LONG_NAME = "n" * 63  # valid alone; "-1" makes it 65 characters


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StateDir:
    monkeypatch.setenv("SNAPCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SNAPCTL_NO_AGENT", "1")
    return StateDir(tmp_path / "state")


@pytest.fixture
def image(state: StateDir) -> Path:
    """A published image in the state's default image root."""
    path = state.root / "images" / "sample"
    publish_sample(path)
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def request_fields(image: Path, **changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"image": str(image), "allow_mismatch": (), "name": None,
                              "count": 1, "publish": None, "expose": False,
                              "into_container": None}  # fmt: skip
    fields.update(changes)
    return fields


def as_request(fields: dict[str, Any]) -> CopyRequest:
    publish = fields["publish"]
    return CopyRequest(
        image=fields["image"], allow_mismatch=tuple(fields["allow_mismatch"]),
        name=fields["name"], count=fields["count"], expose=fields["expose"],
        publish=None if publish is None else {"address": publish[0], "port": publish[1]},
        into_container=fields["into_container"],
    )  # fmt: skip


def as_argv(fields: dict[str, Any]) -> list[str]:
    argv = ["copy", "--image", fields["image"], "--count", str(fields["count"]), "--no-lazy"]
    for waiver in fields["allow_mismatch"]:
        argv += ["--allow-mismatch", waiver]
    if fields["name"] is not None:
        argv += ["--name", fields["name"]]
    if fields["publish"] is not None:
        argv += ["--publish", f"{fields['publish'][0]}:{fields['publish'][1]}"]
    if fields["expose"]:
        argv.append("--expose")
    if fields["into_container"] is not None:
        argv += ["--into-container", fields["into_container"]]
    return argv


# (the request's fields, the option blamed, what the message says): the first refusal wins.
USAGE_CASES = [
    ({"allow_mismatch": ("nonsense",), "name": LONG_NAME, "count": 2, "expose": True},
     "'--allow-mismatch'", "unknown identity field 'nonsense'"),
    ({"allow_mismatch": ("files",)}, "'--allow-mismatch'", "file content mismatches cannot be"),
    ({"name": LONG_NAME, "count": 2, "expose": True}, "'--name' with '--count'",
     "invalid name"),
    ({"count": 2, "publish": ("127.0.0.1", 65535)}, "--publish",
     "2 copies from port 65535 need ports up to 65536, past 65535; give a lower first port"),
    ({"expose": True, "image": "/nowhere"}, "",
     "--expose only widens --publish; give --publish ADDR:PORT"),
    ({"count": 2, "into_container": "placeholder"}, "'--count' with '--into-container'",
     "--count 2 with --into-container: a container hosts one copy"),
]  # fmt: skip


def agent_service(state: StateDir) -> AgentService:
    return AgentService(state, pool=None, spawner=None, metrics=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "option", "message"), USAGE_CASES)
def test_every_caller_refuses_first_the_same_and_names_the_same_option(
    state: StateDir, image: Path, changes: dict[str, Any], option: str, message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    fields = {**request_fields(image), **changes}
    notes: list[Any] = []
    with pytest.raises(CopyUsageError) as direct:
        check_copy_start(**fields, state=state, note=notes.append)
    assert direct.value.option == option and message in direct.value.message
    assert direct.value.exit_status == ExitStatus.USAGE and notes == []

    with pytest.raises(BadRequestError) as agent:
        agent_service(state).check_copy(as_request(fields), notes.append)
    assert (agent.value.message, agent.value.usage) == (direct.value.message, option)

    with pytest.raises(CopyUsageError) as supervisor:
        check_request(as_request(fields), state)
    assert (supervisor.value.message, supervisor.value.option) == (direct.value.message, option)

    assert main(as_argv(fields)) == ExitStatus.USAGE
    err = " ".join(capsys.readouterr().err.split())  # click wraps long lines
    shown = f"Invalid value for {option}: " if option else "Error: "
    assert shown + " ".join(direct.value.message.split()) in err
    assert notes == []


def test_a_name_in_use_is_refused_after_the_names_checks_and_before_publish(
    state: StateDir, image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fields = request_fields(image, name="web", count=2, expose=True)
    held = state.reserve_name("web-2")
    try:
        with pytest.raises(NameInUseError, match="'web-2' is in use"):
            check_copy_start(**fields, state=state, note=print)
        with pytest.raises(NameInUseError, match="'web-2' is in use"):
            agent_service(state).check_copy(as_request(fields), print)
        assert main(as_argv(fields)) == ExitStatus.CONFLICT  # in-process, nothing started
        assert "'web-2' is in use" in capsys.readouterr().err
        # Where the start reserves the names itself, they are not looked up here.
        with pytest.raises(CopyUsageError, match="--expose only widens"):
            check_request(as_request(fields))
    finally:
        held.release()
    state.reserve_name("web-1").release()  # the check let go of what it tried


def test_a_port_in_use_is_refused_before_the_image_is_looked_at(
    state: StateDir, tmp_path: Path, busy_port: int
) -> None:
    fields = request_fields(tmp_path / "nowhere", publish=("127.0.0.1", busy_port))
    with pytest.raises(SnapctlError) as refused:
        check_copy_start(**fields, state=state, note=print)
    assert refused.value.exit_status == ExitStatus.CONFLICT and str(busy_port) in str(refused.value)
    with pytest.raises(SnapctlError) as again:
        check_request(as_request(fields), state)
    assert type(again.value) is type(refused.value) and again.value.message == refused.value.message


def test_an_image_that_is_not_there_is_refused_before_the_notes(
    state: StateDir, tmp_path: Path
) -> None:
    notes: list[str] = []
    fields = request_fields(tmp_path / "nowhere", allow_mismatch=("host_id",))
    with pytest.raises(SnapctlError, match="neither an image directory nor a registry"):
        check_copy_start(**fields, state=state, note=notes.append)
    assert notes == []


def test_needless_waivers_are_noted_and_the_image_returned(
    state: StateDir, image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes: list[str] = []
    fields = request_fields(image, allow_mismatch=("kernel", "host_id", "env"))
    assert check_copy_start(**fields, state=state, note=notes.append) == image.absolute()
    assert notes == [
        "--allow-mismatch env is not needed: env never refuses a copy",
        "--allow-mismatch host_id is not needed: host_id never refuses a copy",
    ]
    emitted: list[dict[str, Any]] = []
    agent_service(state).check_copy(as_request(fields), emitted.append)
    assert emitted == [{"note": note} for note in notes]
    reference = {**fields, "image": "localhost:5000/repo:tag"}
    assert check_copy_start(**reference, state=state, note=notes.append) is None  # pulled later


@pytest.mark.parametrize("lazy", [True, False])
def test_the_lazy_default_is_decided_by_the_image_s_pages_and_noted(
    tmp_path: Path, lazy: bool
) -> None:
    pages = LAZY_DEFAULT_MIN_BYTES // PAGE_SIZE - (0 if lazy else 1)
    publish_sample(tmp_path / "image", dump_stats=DumpStats(pages_written=pages))
    notes: list[str] = []
    assert decide_lazy(None, tmp_path / "image", notes.append) is lazy
    expected = [
        f"restoring lazily: the image holds {LAZY_DEFAULT_MIN_BYTES >> 20} MiB of pages or more "
        "(--no-lazy: restore every page first)"
    ]
    assert notes == (expected if lazy else [])
    assert decide_lazy(None, tmp_path / "image") is lazy  # no note asked for: none said


@pytest.mark.parametrize("requested", [True, False])
def test_a_requested_lazy_is_kept_without_reading_the_image(
    tmp_path: Path, requested: bool
) -> None:
    notes: list[str] = []
    assert decide_lazy(requested, tmp_path / "no-image", notes.append) is requested
    assert notes == []


def test_the_lazy_option_s_help_names_the_tuned_threshold() -> None:
    assert f"at least {LAZY_DEFAULT_MIN_BYTES >> 20} MiB of pages" in lazy_help()


def test_a_supervisor_checks_the_publish_target_where_the_agent_did(
    state: StateDir, image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy bound for a container: its port is looked at in the container's network (its
    # first process's), never the host's, by the agent and by the supervisor alike.
    from types import SimpleNamespace

    from snapctl.activation import container, precheck

    seen: list[int | None] = []
    monkeypatch.setattr(container, "resolve_container", lambda ref: SimpleNamespace(pid=4242))
    monkeypatch.setattr(
        precheck, "check_publish_target",
        lambda publish, expose, count, *, inside=None: seen.append(inside),
    )  # fmt: skip
    fields = request_fields(image, publish=("127.0.0.1", 18000))
    request = as_request(fields).model_copy(update={"into_container": "placeholder"})
    agent_service(state).check_copy(request, print)
    check_request(request, state)
    assert seen == [4242, 4242]
