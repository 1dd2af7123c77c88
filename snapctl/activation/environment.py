"""The environment a launched server gets: a minimal one, plus what the caller names.

A captured tree's memory holds its environment, and an image carries that memory wherever it is
pushed or exported. So a server does not inherit the caller's whole environment: it gets the
variables every process needs (:data:`BASE_NAMES`, the locale's ``LC_*``), vLLM's settings
(``VLLM_*``, except a name that looks secret, such as ``VLLM_API_KEY``: that one only when
named), the variable ``--api-key-env`` names (the server reads its key there), and what
``--env NAME[=VALUE]`` and ``--env-file FILE`` give; ``--inherit-env`` gives it the caller's
whole environment instead, with the risk its help names.

``--env`` and ``--env-file`` follow podman's rules: the files are read first, in order, then
each ``--env``, a later one replacing an earlier one; a line or option ``NAME=VALUE`` sets
``VALUE`` as written (nothing stripped or expanded), ``NAME`` alone takes the caller's value (and
nothing when the caller has none), ``PREFIX*`` every variable of the caller whose name starts
with ``PREFIX``; in a file, blank lines and lines starting with ``#`` are skipped, and leading
whitespace is ignored. They are resolved where the command runs (the CLI, the client of an
agent); the selection above is applied where the server is launched (the CLI in-process, or
the agent's supervisor, which has taken the client's environment).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from snapctl.activation.launch import LaunchOptions
    from snapctl.images.manifest import Manifest

# What every process expects (its programs, home, locale, terminal, zone), Python's path and
# the GPUs a server may use.
BASE_NAMES = frozenset(
    {"PATH", "HOME", "LANG", "LANGUAGE", "TERM", "TZ", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"}
)
BASE_PREFIXES = ("LC_",)
# Settings of the server snapctl is built for, passed unless the name looks secret.
SETTINGS_PREFIXES = ("VLLM_",)
# A name holding one of these words (any case) looks like it holds a secret.
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_WHITESPACE = re.compile(r"\s")


def looks_secret(name: str) -> bool:
    """True for a name like ``HF_TOKEN``, ``api_key``, ``DB_PASSWORD`` (case-insensitive)."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def secret_looking(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that look secret, sorted."""
    return sorted({name for name in names if looks_secret(name)})


def passes_by_default(name: str) -> bool:
    """Whether a server gets the caller's ``name`` without being told (see the module)."""
    if name in BASE_NAMES or name.startswith(BASE_PREFIXES):
        return True
    return name.startswith(SETTINGS_PREFIXES) and not looks_secret(name)


def check_name(name: str) -> str:
    """``name`` if the kernel and ``os.environ`` take it as a variable's name (a ``PREFIX*``
    pattern is checked as its prefix), else ValueError."""
    if not name or "=" in name or "\0" in name or _WHITESPACE.search(name):
        raise ValueError(f"{name!r} is not an environment variable name (empty, or holds "
                         "'=', whitespace or NUL)")  # fmt: skip
    if "*" in name[:-1] or name == "*":
        raise ValueError(f"{name!r}: '*' may only end a name, after a prefix (PREFIX*)")
    return name


def apply_env(given: dict[str, str], item: str, caller: Mapping[str, str], where: str) -> None:
    """One ``NAME[=VALUE]`` or ``PREFIX*`` (podman's rules), into ``given``; a ValueError
    names ``where`` (if not empty) and the name, never a value."""
    name, has_value, value = item.partition("=")
    name = name.lstrip()
    prefix = f"{where}: " if where else ""
    try:
        check_name(name)
    except ValueError as error:
        raise ValueError(f"{prefix}{error}") from None
    if has_value:
        if name.endswith("*"):
            raise ValueError(f"{prefix}{name}: a PREFIX* pattern takes no value")
        if "\0" in value:
            raise ValueError(f"{prefix}the value of {name} holds NUL")
        given.pop(name, None)
        given[name] = value
    elif name.endswith("*"):
        for found, found_value in caller.items():
            if found.startswith(name[:-1]):
                given.pop(found, None)
                given[found] = found_value
    elif name in caller:
        given.pop(name, None)
        given[name] = caller[name]


def read_env_file(path: Path, caller: Mapping[str, str], given: dict[str, str]) -> None:
    """The variables of one ``--env-file`` into ``given`` (ValueError naming the line)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip()
        if stripped and not stripped.startswith("#"):
            apply_env(given, stripped, caller, f"{path}, line {number}")


def server_environment(options: LaunchOptions, caller: Mapping[str, str]) -> dict[str, str]:
    """The environment a server launched with ``options`` gets from ``caller`` (the launching
    process's): the defaults and the API key's variable, or everything with ``inherit_env``,
    then ``options.env`` over them. What snapctl itself adds (the fixture's key, the facts
    file's path) its launcher adds afterwards."""
    if options.inherit_env:
        env = dict(caller)
    else:
        env = {
            name: value
            for name, value in caller.items()
            if passes_by_default(name) or name == options.api_key_env
        }
    env.update(options.env)
    return env


def restorer_environment(here: Mapping[str, str], recorded: Iterable[str]) -> dict[str, str]:
    """What of a restorer's environment its copy's identity check compares with the captured
    one: the names the image recorded, and those a capture here would have passed by default
    (another variable here is one no capture would have given its server either)."""
    names = set(recorded)
    return {name: value for name, value in here.items() if name in names or passes_by_default(name)}


def captured_names(manifest: Manifest) -> tuple[list[str], bool]:
    """The names of the environment ``manifest``'s server was launched with, and whether that
    is all of them: an image captured before they were recorded has only its identity's record
    (which leaves out snapctl's own and terminal variables), its server having had its caller's
    whole environment."""
    if manifest.server_env_names is not None:
        return list(manifest.server_env_names), True
    return (sorted(manifest.identity.env) if manifest.identity else []), False


def secret_env_warning(manifest: Manifest, image: str) -> str | None:
    """The warning ``image push`` and ``image export`` print for ``image`` when its server's
    environment, which its memory and so the image holds, has a name that looks secret, or is
    not known (None: nothing to warn about). Names only, never a value."""
    names, complete = captured_names(manifest)
    secrets = secret_looking(names)
    if not complete:
        among = f" ({', '.join(secrets)} among its names look secret)" if secrets else ""
        return (
            f"warning: {image} was captured with the whole environment of the snapctl that "
            f"captured it{among}: every value is in the image's memory (criu/pages-*.img) and "
            "travels with it; bake it again with this snapctl, whose servers get only what "
            "--env names"
        )
    if not secrets:
        return None
    return (
        f"warning: {image}'s server was launched with {', '.join(secrets)} in its environment, "
        "which look secret: their values are in the image's memory (criu/pages-*.img) and "
        "travel with it; bake it again without them if they must not leave this host"
    )
