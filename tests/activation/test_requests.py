"""The requests that start something refuse what no entry may send them, whoever sends it (the
CLI and the thin client make paths absolute before they send), and the bodies the clients build
read the same in-process (a dict) as in the agent (JSON)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from snapctl.activation.requests import BakeRequest, CopyRequest, DonorRequest
from snapctl.thin import copy_request_body

CAPTURE = {"image": "/images/x", "cwd": "/", "environ": {}}


def request(model: type[Any], **fields: Any) -> Any:
    base = {"image": "/images/x"} if model is CopyRequest else CAPTURE
    return model.model_validate({**base, **fields})


@pytest.mark.parametrize("model", [CopyRequest, BakeRequest, DonorRequest])
@pytest.mark.parametrize("path", ["criu", "bin/criu", "./criu", "", "~/criu"])
def test_a_criu_path_must_be_absolute(model: type[Any], path: str) -> None:
    with pytest.raises(ValidationError, match="criu_path"):
        request(model, criu_path=path)


@pytest.mark.parametrize("model", [CopyRequest, BakeRequest, DonorRequest])
@pytest.mark.parametrize("path", [None, "/opt/snapctl/criu", "/usr/sbin/criu"])
def test_an_absolute_criu_path_or_none_is_taken(model: type[Any], path: str | None) -> None:
    assert request(model, criu_path=path).criu_path == path


def test_the_copy_request_the_clients_build_makes_the_criu_path_absolute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    body = copy_request_body("image", criu_path="bin/criu")  # read as the agent reads it
    read = CopyRequest.model_validate_json(json.dumps(body))
    assert read.criu_path == str(tmp_path / "bin" / "criu")


def test_the_clients_copy_body_reads_the_same_in_process_as_the_agent_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CLI in-process reads the body it built as a dict (lax: its lists stand for the
    model's tuples); the agent reads the same body sent as JSON. Every field given."""
    monkeypatch.setenv("MY_KEY", "secret")
    body = copy_request_body(
        "/images/x", count=3, allow_mismatch=("kernel", "cpu_flags"), lazy=True,
        server_argv=("python", "-m", "server"), name="c", publish=("0.0.0.0", 18000),
        expose=True, host="127.0.0.2", port=9000, api_key_env="MY_KEY", timeout_s=12.5,
        native="cuda-checkpoint", criu_path="/opt/criu", detach=True,
        memory_bytes=1 << 30, cpus=1.5, into_container="placeholder-1",
    )  # fmt: skip
    agent = CopyRequest.model_validate_json(json.dumps(body))
    assert CopyRequest.model_validate(body, strict=False) == agent
    sent = {name: value for name, value in body.items() if name != "api_key"}
    assert agent.model_dump(mode="json", exclude={"api_key"}) == {"version": 1, **sent}
    assert agent.api_key is not None and agent.api_key.get_secret_value() == "secret"


@pytest.mark.parametrize("donor", [False, True])
def test_the_clients_capture_body_reads_the_same_in_process_as_the_agent_reads_it(
    donor: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from snapctl.cli._activation_options import CommonOptions
    from snapctl.cli.remote import capture_request

    monkeypatch.chdir(tmp_path)
    common = CommonOptions(
        name="d", host="127.0.0.1", port=8000, publish=("127.0.0.1", 18000), expose=False,
        api_key_env="MY_KEY", timeout_s=60.0, criu_path="/opt/criu", native="none",
        detach=True, as_json=True, memory_bytes=1 << 30, cpus=2.0,
    )  # fmt: skip
    body = capture_request(Path("image"), True, ("127.0.0.2",), 900.0, 900.0,
                           ("python", "-m", "server"), common, donor=donor)  # fmt: skip
    model = DonorRequest if donor else BakeRequest
    agent = model.model_validate_json(json.dumps(body))
    assert model.model_validate(body, strict=False) == agent
    assert agent.image == str(tmp_path / "image") and agent.lo_addresses == ("127.0.0.2",)
