"""``--env``, ``--env-file`` and ``--inherit-env``: the environment of a server a command
launches (``donor``, ``bake``, ``qualify``), beyond the minimal one it gets anyway (see
:mod:`snapctl.activation.environment`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click


@dataclass(frozen=True)
class ServerEnv:
    """What the options give: ``given`` (``--env``/``--env-file``, resolved against this
    process's environment) and ``inherit`` (``--inherit-env``)."""

    given: dict[str, str] = field(default_factory=dict)
    inherit: bool = False


def server_env_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options; the command receives them as ``server_env: ServerEnv``."""

    @functools.wraps(function)
    def wrapper(**kwargs: Any) -> Any:
        from snapctl.activation.environment import apply_env, read_env_file

        options, files = kwargs.pop("env_options"), kwargs.pop("env_files")
        given: dict[str, str] = {}
        # podman's order: the files first, then each --env, a later one replacing an earlier.
        try:
            for path in files:
                read_env_file(path, os.environ, given)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--env-file") from error
        for item in options:
            try:
                apply_env(given, item, os.environ, "")
            except ValueError as error:
                raise click.BadParameter(str(error), param_hint="--env") from error
        inherit = kwargs.pop("inherit_env")
        return function(server_env=ServerEnv(given=given, inherit=inherit), **kwargs)

    for decorator in reversed(
        (
            click.option(
                "--env", "env_options", multiple=True, metavar="NAME[=VALUE]",
                help="Give the server this variable: NAME=VALUE, or NAME alone for this "
                "environment's value (PREFIX* for every variable starting so). Repeatable. The "
                "server otherwise gets only PATH, HOME, the locale, TERM, TZ, PYTHONPATH, "
                "CUDA_VISIBLE_DEVICES, VLLM_* and the --api-key-env variable: its memory, "
                "environment included, is in the image.",
            ),
            click.option(
                "--env-file", "env_files", multiple=True, metavar="FILE",
                type=click.Path(dir_okay=False, path_type=Path),
                help="Read NAME=VALUE lines (# comments; NAME alone as --env NAME) from FILE, "
                "before the --env options. Repeatable.",
            ),
            click.option(
                "--inherit-env", "inherit_env", is_flag=True,
                help="Give the server this whole environment instead. Risky: every variable, "
                "tokens and keys included, is then in the image's memory and travels with it "
                "(push, export).",
            ),
        )
    ):  # fmt: skip
        wrapper = decorator(wrapper)
    return wrapper
