"""The ordinary reference start, and what qualification knows about the server command.

The reference is the same server launched the same way (fresh namespaces, same host and port,
same environment) but without ``--snapshot-config``: it loads and binds at once, with no
capture and no activation. Its answers are what every donor and copy must reproduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from snapctl.activation.core import new_session
from snapctl.activation.environment import server_environment
from snapctl.activation.handshake import probe_http_ready
from snapctl.activation.launch import (
    LaunchError,
    LaunchOptions,
    fixture_command,
    launch_in_sandbox,
    repo_root,
)
from snapctl.activation.session import Session
from snapctl.activation.states import SessionState
from snapctl.activation.timeouts import ready_timeout_hint
from snapctl.errors import SnapctlError
from snapctl.images.manifest import Manifest
from snapctl.logtail import log_tail
from snapctl.namespaces.netns import NetnsConnector, Publisher
from snapctl.phases import HostPhase
from snapctl.progress import Progress
from snapctl.statedir import StateDir

SNAPSHOT_FLAG = "--snapshot-config"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


VLLM_BRIDGE = "snapctl.launcher.vllm"


def _runs_module(argv: list[str], module: str) -> bool:
    """Whether ``argv`` is ``python -m MODULE ... serve ...``."""
    return (
        any(argv[i] == "-m" and argv[i + 1] == module for i in range(len(argv) - 1))
        and "serve" in argv
    )


def is_fixture(argv: list[str]) -> bool:
    """Whether ``argv`` runs the bundled fixture server (``python -m fixtures serve``)."""
    return _runs_module(argv, "fixtures")


def is_vllm_bridge(argv: list[str]) -> bool:
    """Whether ``argv`` runs vLLM through snapctl's bridge (``python -m snapctl.launcher.vllm``)."""
    return _runs_module(argv, VLLM_BRIDGE)


def model_argument(argv: list[str]) -> str | None:
    """``--model``, or the first argument after ``serve`` (``vllm serve MODEL``)."""
    model = flag_value(argv, "--model")
    if model is None and "serve" in argv:
        following = argv[argv.index("serve") + 1 :]
        model = next((arg for arg in following[:1] if not arg.startswith("-")), None)
    return model


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` (the last one wins), or None."""
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def without_snapshot_config(argv: list[str]) -> list[str]:
    result: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == SNAPSHOT_FLAG:
            skip = True
        elif not arg.startswith(SNAPSHOT_FLAG + "="):
            result.append(arg)
    return result


def server_from_manifest(manifest: Manifest) -> tuple[list[str], Path]:
    """The captured server's command (without the capture flag) and cwd, for a reference."""
    argv = without_snapshot_config(manifest.server_argv)
    if any("***" in arg for arg in argv):
        raise SnapctlError(
            "the image's server command has redacted secrets: give the server command after --"
        )
    return argv, Path(manifest.server_cwd)


def server_command(options: LaunchOptions, state: StateDir) -> tuple[list[str], Path]:
    """The server command for ``options`` without the capture flag (the fixture by default)."""
    if options.server_argv:
        return without_snapshot_config(list(options.server_argv)), Path.cwd()
    return fixture_command(options, state)


def weights_files(argv: list[str]) -> list[Path]:
    """The model weights files a server reads: ``--model`` itself, or those in its directory."""
    model = model_argument(argv)
    if model is None:
        return []
    path = Path(model)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def weights_file(argv: list[str]) -> Path | None:
    """The largest of :func:`weights_files`."""
    return max(weights_files(argv), key=lambda p: p.stat().st_size, default=None)


def model_file_digests(argv: list[str]) -> dict[str, str] | None:
    """sha256 of every parameter of the model's files, read from disk, for the fixture and for
    vLLM through snapctl's bridge (in vLLM's parameter names and layout); None otherwise."""
    model = model_argument(argv)
    if model is None:
        return None
    if is_fixture(argv):
        command = [argv[0], "-m", "fixtures", "reference-digests", "--model", model]
    elif is_vllm_bridge(argv):
        command = [argv[0], "-m", VLLM_BRIDGE, "reference-digests", model]
    else:
        return None
    proc = subprocess.run(
        command, cwd=repo_root(), capture_output=True, text=True, check=False, timeout=300
    )
    if proc.returncode != 0:
        raise SnapctlError(f"{' '.join(command[1:4])} failed: {proc.stderr.strip()[-300:]}")
    payload = json.loads(proc.stdout)
    return {str(name): str(digest) for name, digest in payload.items()}


def start_reference(
    argv: list[str],
    cwd: Path,
    options: LaunchOptions,
    *,
    state: StateDir,
    publish: tuple[str, int],
    progress: Progress,
) -> tuple[Session, float]:
    """Launch the ordinary server and wait for its first HTTP 200; return it and that time."""
    state.ensure()
    session = new_session(state, "reference", None, options=options)
    env = server_environment(options, os.environ)  # the donor's, exactly
    if options.api_key and not options.server_argv:
        # Exactly as start_donor gives the key to the bundled fixture.
        env["FIXTURE_API_KEY"] = options.api_key
    try:
        progress("launching the ordinary reference (no capture)")
        started = time.monotonic()
        session.advance(SessionState.LAUNCHING)
        session.launched(*launch_in_sandbox(argv, cwd, session.dirs, options, env))
        connector = session.connector = NetnsConnector(session.tree.pid)
        session.publisher = Publisher(connector, *publish, (options.host, options.port))
        try:
            probe_http_ready(
                connector, options.host, options.port, api_key=options.api_key,
                timeout_s=options.ready_timeout_s, alive=session.tree.alive,
                timeout_hint=ready_timeout_hint(),
            )  # fmt: skip
        except SnapctlError as error:
            raise LaunchError(
                f"the reference server never served: {error.message}",
                phase=HostPhase.REFERENCE,
                path=session.dirs.server_log,
                log_tail=log_tail(session.dirs.server_log),
            ) from error
        ready_s = time.monotonic() - started
        session.remember_tree()
        session.advance(SessionState.SERVING)
        return session, ready_s
    except BaseException:
        session.stop()
        raise
