"""The environment a launched server gets (no root): the defaults, ``--env``/``--env-file`` by
podman's rules, ``--inherit-env``, what a copy compares, and the warning for secret-looking
names."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.activation.environment import (
    apply_env,
    captured_names,
    looks_secret,
    passes_by_default,
    read_env_file,
    restorer_environment,
    secret_env_warning,
    server_environment,
)
from snapctl.activation.launch import LaunchOptions
from tests.images.factories import make_manifest

CALLER = {
    "PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
    "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_API_KEY": "vllm-secret", "HF_TOKEN": "hf-secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret", "SNAPCTL_STATE_DIR": "/state", "FOO": "foo",
    "MY_KEY": "my-key", "CUDA_VISIBLE_DEVICES": "1",
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "secret"),
    [("HF_TOKEN", True), ("api_key", True), ("DbPassword", True), ("CLIENT_SECRET", True),
     ("PATH", False), ("VLLM_CPU_KVCACHE_SPACE", False), ("TOKENIZERS_PARALLELISM", True)],
)  # fmt: skip
def test_names_that_look_secret(name: str, secret: bool) -> None:
    assert looks_secret(name) is secret


def test_a_server_gets_the_defaults_and_the_api_key_variable_only() -> None:
    env = server_environment(LaunchOptions(api_key_env="MY_KEY"), CALLER)
    assert env == {
        "PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
        "VLLM_CPU_KVCACHE_SPACE": "4", "CUDA_VISIBLE_DEVICES": "1", "MY_KEY": "my-key",
    }  # fmt: skip
    # A vLLM setting that looks secret passes only when named.
    assert not passes_by_default("VLLM_API_KEY") and passes_by_default("VLLM_USE_V1")
    named = server_environment(LaunchOptions(env={"VLLM_API_KEY": "given"}), CALLER)
    assert named["VLLM_API_KEY"] == "given" and "HF_TOKEN" not in named


def test_inherit_env_gives_everything_and_given_values_win() -> None:
    options = LaunchOptions(inherit_env=True, env={"FOO": "bar", "NEW": "1"})
    assert server_environment(options, CALLER) == {**CALLER, "FOO": "bar", "NEW": "1"}


def test_env_options_follow_podman() -> None:
    given: dict[str, str] = {}
    for item in ("FOO", "UNSET", "A=1=2", "EMPTY=", "VLLM_*", "A=3", "  SPACED=x y "):
        apply_env(given, item, CALLER, "--env")
    assert given == {
        "FOO": "foo",  # NAME alone: the caller's value; an unset one gives nothing
        "EMPTY": "",
        "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_API_KEY": "vllm-secret",  # PREFIX*: all, named
        "A": "3",  # a later one replaces an earlier one; the value is as written
        "SPACED": "x y ",
    }  # fmt: skip
    assert list(given)[-2:] == ["A", "SPACED"]  # replaced: it counts as the later one


@pytest.mark.parametrize(
    ("item", "message"),
    [("=v", "'' is not an environment variable name"),
     ("A B=secret", "'A B' is not an environment variable name"),
     ("A*B", "'\\*' may only end a name"), ("*", "may only end a name"),
     ("P*=secret", "P\\*: a PREFIX\\* pattern takes no value")],
)  # fmt: skip
def test_refused_env_options_never_echo_a_value(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        apply_env({}, item, CALLER, "--env")
    assert "secret" not in str(info.value)


def test_an_env_file_has_lines_comments_and_pass_through_names(tmp_path: Path) -> None:
    path = tmp_path / "server.env"
    path.write_text("# the server's settings\n\n  HF_HOME=/models/hf\nFOO\n   # indented\n"
                    "QUOTED=\"kept\" # as written\nHF_TOKEN\r\n")  # fmt: skip
    given = {"HF_HOME": "earlier"}
    read_env_file(path, CALLER, given)
    assert given == {"HF_HOME": "/models/hf", "FOO": "foo", "QUOTED": '"kept" # as written',
                     "HF_TOKEN": "hf-secret"}  # fmt: skip
    path.write_text("GOOD=1\nBAD NAME=secret-value\n")
    with pytest.raises(ValueError, match=rf"{path}, line 2: 'BAD NAME' is not") as info:
        read_env_file(path, CALLER, {})
    assert "secret-value" not in str(info.value)
    with pytest.raises(ValueError, match="No such file"):
        read_env_file(tmp_path / "missing.env", CALLER, {})


def test_a_copy_compares_what_a_capture_here_would_have_given() -> None:
    here = restorer_environment(CALLER, ["FOO", "GONE"])
    assert "FOO" in here and "PATH" in here and "VLLM_CPU_KVCACHE_SPACE" in here
    assert "HF_TOKEN" not in here and "SNAPCTL_STATE_DIR" not in here and "GONE" not in here


def test_push_and_export_warn_on_names_that_look_secret() -> None:
    clean = make_manifest({}, server_env_names=["HOME", "PATH", "VLLM_USE_V1"])
    assert captured_names(clean) == (["HOME", "PATH", "VLLM_USE_V1"], True)
    assert secret_env_warning(clean, "img") is None
    keyed = make_manifest({}, server_env_names=["FIXTURE_API_KEY", "HF_TOKEN", "PATH"])
    warning = secret_env_warning(keyed, "img")
    assert warning is not None and "FIXTURE_API_KEY, HF_TOKEN" in warning
    assert "PATH" not in warning and "criu/pages-*.img" in warning
    # An image from before the names were kept had its capturer's whole environment.
    older = make_manifest({})
    assert older.server_env_names is None
    assert captured_names(older) == (["HF_TOKEN", "PATH"], False)
    warning = secret_env_warning(older, "img")
    assert warning is not None and "whole environment" in warning and "HF_TOKEN" in warning
    assert "hf_secret_value" not in warning
