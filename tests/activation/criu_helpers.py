"""Shared pieces of the real-CRIU activation tests: launch options, HTTP helpers, audits."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from snapctl.activation.copy import start_copy
from snapctl.activation.core import ActivationReport
from snapctl.activation.donor import start_donor
from snapctl.activation.launch import LaunchOptions
from snapctl.activation.native import NativeStep, NoNativeStep
from snapctl.activation.session import Session
from snapctl.criu import CriuBinary
from snapctl.namespaces import mounts
from snapctl.statedir import StateDir

API_KEY = "test-key-123"
API_KEY_ENV = "SNAPCTL_TEST_API_KEY"
PROMPT = "The capital of"
PUBLISH = ("127.0.0.1", 0)  # an ephemeral host port


def options(**changes: object) -> LaunchOptions:
    """Launch options with an API key (from ``API_KEY_ENV``) and a generous timeout."""
    base = LaunchOptions(api_key_env=API_KEY_ENV, timeout_s=120)
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def get(published: str, path: str, key: str | None = API_KEY) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(f"http://{published}{path}")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def complete(published: str) -> tuple[list[float], str]:
    """A greedy completion through the ``openai`` client: (log probabilities, text)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{published}/v1", api_key=API_KEY, max_retries=0)
    result = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=8, temperature=0,
        logprobs=1,
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs
    return [round(x, 4) for x in choice.logprobs.token_logprobs if x is not None], choice.text


def stop_clean(session: Session) -> None:
    how, audit = session.stop()
    assert audit.clean, audit.describe()
    assert how in ("terminated", "killed", "exited")


def leftovers(state: StateDir, activation_ids: list[str] = []) -> list[str]:  # noqa: B006
    """Anything of an activation still present: directories, mounts, and any process that
    still sees one of ``activation_ids``' tmpfs (found even when its PID was never known)."""
    found = [str(p) for p in state.activations.iterdir()] if state.activations.exists() else []
    found += mounts.mounts_under(state.root)
    for activation_id in activation_ids:
        pids = mounts.processes_with_mount(f"snapctl-{activation_id}", "/dev/shm")
        found += [f"pid {pid} of {activation_id}" for pid in pids]
    return found


def image_files(image: Path) -> list[str]:
    return sorted(str(p.relative_to(image)) for p in image.rglob("*") if p.is_file())


def launch_donor(
    image: Path,
    state: StateDir,
    criu: CriuBinary,
    *,
    publish: tuple[str, int] | None = None,
    native: NativeStep | None = None,
    activate: bool = True,
    **changes: object,
) -> tuple[Session, ActivationReport]:
    """``start_donor`` with the tests' defaults: ``options(**changes)``, no native step, no
    ``--force``, no progress output."""
    session, report = start_donor(
        options(**changes), image=image, force=False, criu=criu, native=native or NoNativeStep(),
        publish=publish, state=state, progress=lambda step: None, activate_donor=activate,
    )  # fmt: skip
    return session, report


def restore_copy(
    image: Path,
    state: StateDir,
    criu: CriuBinary,
    *,
    publish: tuple[str, int] | None = None,
    lazy: bool = False,
    **changes: object,
) -> tuple[Session, ActivationReport]:
    """``start_copy`` with the tests' defaults: ``options(**changes)``, no native step."""
    return start_copy(
        image, options(**changes), criu=criu, native=NoNativeStep(), publish=publish,
        state=state, progress=lambda step: None, lazy=lazy,
    )  # fmt: skip
