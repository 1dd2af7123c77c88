"""The requests that start something refuse what no entry may send them, whoever sends it (the
CLI and the thin client make paths absolute before they send)."""

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
