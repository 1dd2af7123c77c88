"""The v1 models: strict types, no extra keys, exact version, immutability, oracle matching."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from snapctl.protocol.models import (
    CONTROL_MODELS,
    Activation,
    CaptureReady,
    Challenge,
    ControlFile,
    ErrorReport,
    Oracle,
    Release,
    SnapshotConfig,
    Status,
)
from tests.protocol.factories import (
    activation_fields,
    challenge_fields,
    error_fields,
    make_activation,
    make_challenge,
    make_oracle,
    oracle_fields,
    ready_fields,
    status_fields,
)

ALL_MODELS: list[tuple[type[BaseModel], Callable[..., dict[str, Any]]]] = [
    (CaptureReady, ready_fields),
    (Activation, activation_fields),
    (Challenge, challenge_fields),
    (Release, challenge_fields),
    (Status, status_fields),
    (ErrorReport, error_fields),
    (Oracle, oracle_fields),
]
MODEL_IDS = [model.__name__ for model, _ in ALL_MODELS]


@pytest.mark.parametrize(("model", "fields"), ALL_MODELS, ids=MODEL_IDS)
def test_valid_payload_round_trips(
    model: type[BaseModel], fields: Callable[..., dict[str, Any]]
) -> None:
    instance = model.model_validate(fields())
    assert instance.model_dump(mode="json") == fields()


@pytest.mark.parametrize(("model", "fields"), ALL_MODELS, ids=MODEL_IDS)
def test_extra_key_is_rejected(
    model: type[BaseModel], fields: Callable[..., dict[str, Any]]
) -> None:
    with pytest.raises(ValidationError, match="extra"):
        model.model_validate(fields(unexpected=1))


@pytest.mark.parametrize(("model", "fields"), ALL_MODELS, ids=MODEL_IDS)
def test_instances_are_frozen(
    model: type[BaseModel], fields: Callable[..., dict[str, Any]]
) -> None:
    instance = model.model_validate(fields())
    name = next(iter(type(instance).model_fields))
    with pytest.raises(ValidationError):
        setattr(instance, name, getattr(instance, name))


@pytest.mark.parametrize(
    ("model", "fields"),
    [(CaptureReady, ready_fields), (Activation, activation_fields), (Challenge, challenge_fields)],
)
@pytest.mark.parametrize("version", [2, 0, 1.0, True, "1", None])
def test_version_must_be_the_integer_one(
    model: type[BaseModel], fields: Callable[..., dict[str, Any]], version: object
) -> None:
    with pytest.raises(ValidationError, match="version"):
        model.model_validate(fields(version=version))


@pytest.mark.parametrize(
    "changes",
    [
        {"port": "8000"},
        {"port": 8000.0},
        {"port": True},
        {"port": 0},
        {"port": 65536},
        {"native_complete": 1},
        {"native_complete": "true"},
        {"kind": "clone"},
        {"host": 127},
        {"capture_id": "0123456789ABCDEF0123456789ABCDEF"},
        {"capture_id": "short"},
        {"activation_id": ""},
        {"activation_id": "a" * 129},
        {"activation_id": "../escape"},
        {"activation_id": "has space"},
    ],
    ids=repr,
)
def test_activation_wrong_types_and_values_are_rejected(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Activation.model_validate(activation_fields(**changes))


def test_activation_accepts_null_host_and_longest_id() -> None:
    activation = make_activation(host=None, activation_id="a" * 128, kind="donor")
    assert activation.host is None
    assert activation.kind == "donor"


@pytest.mark.parametrize(
    "changes",
    [{"token_ids": [True]}, {"token_ids": ["1"]}, {"text": 5}, {"sampled_token_logprob": "x"}],
    ids=repr,
)
def test_oracle_wrong_types_are_rejected(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Oracle.model_validate(oracle_fields(**changes))


def test_oracle_accepts_integer_logprob_as_float() -> None:
    oracle = make_oracle(sampled_token_logprob=0)
    assert isinstance(oracle.sampled_token_logprob, float)


def test_capture_ready_rejects_bad_pid() -> None:
    with pytest.raises(ValidationError):
        CaptureReady.model_validate(ready_fields(pid=0))
    with pytest.raises(ValidationError):
        CaptureReady.model_validate(ready_fields(pid="1"))


def test_status_phase_is_closed() -> None:
    with pytest.raises(ValidationError):
        Status.model_validate(status_fields(phase="serving"))


def test_error_report_allows_null_activation_id() -> None:
    assert ErrorReport.model_validate(error_fields(activation_id=None)).activation_id is None


def test_release_answering_copies_the_challenge_exactly() -> None:
    challenge = make_challenge()
    release = Release.answering(challenge)
    assert isinstance(release, Release)
    assert release.model_dump() == challenge.model_dump()


def test_every_control_file_has_a_model() -> None:
    assert set(CONTROL_MODELS) == set(ControlFile)


@pytest.mark.parametrize(
    ("other", "fragment"),
    [
        ({"token_ids": [1]}, "token_ids"),
        ({"text": " the"}, "text"),
        ({"sampled_token_logprob": -0.25 + 2e-3}, "sampled_token_logprob"),
        ({"sampled_token_logprob": math.nan}, "sampled_token_logprob"),
    ],
)
def test_oracle_mismatch_names_the_difference(other: dict[str, Any], fragment: str) -> None:
    difference = make_oracle().mismatch(make_oracle(**other))
    assert difference is not None
    assert fragment in difference


def test_oracle_matches_within_tolerance() -> None:
    assert make_oracle().mismatch(make_oracle(sampled_token_logprob=-0.25 + 9e-4)) is None


class TestSnapshotConfig:
    def test_defaults(self) -> None:
        config = SnapshotConfig.model_validate({"mode": "startup", "control_dir": "/run/c"})
        assert config.timeout_s == 900.0

    def test_integer_timeout_is_accepted(self) -> None:
        config = SnapshotConfig.model_validate(
            {"mode": "startup", "control_dir": "/run/c", "timeout_s": 5}
        )
        assert config.timeout_s == 5.0

    @pytest.mark.parametrize("control_dir", ["relative/dir", "/run/../etc", "/run/c/.."])
    def test_control_dir_must_be_absolute_without_dotdot(self, control_dir: str) -> None:
        with pytest.raises(ValidationError, match="control_dir"):
            SnapshotConfig.model_validate({"mode": "startup", "control_dir": control_dir})

    @pytest.mark.parametrize("timeout_s", [0, -1, 0.0, math.nan, math.inf, True, "5"])
    def test_timeout_must_be_positive_finite(self, timeout_s: object) -> None:
        with pytest.raises(ValidationError, match="timeout_s"):
            SnapshotConfig.model_validate(
                {"mode": "startup", "control_dir": "/run/c", "timeout_s": timeout_s}
            )

    def test_unknown_keys_and_modes_are_rejected(self) -> None:
        with pytest.raises(ValidationError):
            SnapshotConfig.model_validate({"mode": "startup", "control_dir": "/c", "x": 1})
        with pytest.raises(ValidationError):
            SnapshotConfig.model_validate({"mode": "manual", "control_dir": "/c"})
