"""The vLLM bridge's pieces that need no vLLM: its command line and the digest comparison."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from snapctl.errors import CanaryMismatchError
from snapctl.launcher.vllm.cli import (
    EXTENSION_FLAG,
    split_snapshot_config,
    with_worker_extension,
)
from snapctl.launcher.vllm.hooks import VllmHooks, digest_difference
from snapctl.launcher.vllm.memory import MemoryOptions, split_memory_options
from snapctl.launcher.vllm.usage import UsageError
from snapctl.launcher.vllm.worker import EXTENSION
from snapctl.protocol.facts import CaptureFacts, MemoryPolicy


def test_snapshot_config_is_taken_out_in_both_spellings() -> None:
    argv = ["/m", "--snapshot-config", '{"mode":"startup"}', "--port", "1"]
    assert split_snapshot_config(argv) == (["/m", "--port", "1"], '{"mode":"startup"}')
    assert split_snapshot_config(["/m", "--snapshot-config={}"]) == (["/m"], "{}")
    assert split_snapshot_config(["/m"]) == (["/m"], None)
    with pytest.raises(UsageError, match="needs a JSON value"):
        split_snapshot_config(["/m", "--snapshot-config"])


def test_the_digest_extension_is_added_once_and_a_foreign_one_refused() -> None:
    assert with_worker_extension(["/m"]) == ["/m", EXTENSION_FLAG, EXTENSION]
    given = ["/m", EXTENSION_FLAG, EXTENSION]
    assert with_worker_extension(given) == given
    with pytest.raises(UsageError, match="taken by snapctl"):
        with_worker_extension(["/m", f"{EXTENSION_FLAG}=my.Extension"])


def test_digest_difference_names_the_first_changed_parameter() -> None:
    loaded = {"a": "1", "b": "2"}
    assert digest_difference(loaded, dict(loaded)) is None
    assert digest_difference(loaded, {"a": "1", "b": "3"}) == "1 parameter(s) changed, first b"
    assert "missing ['b']" in str(digest_difference(loaded, {"a": "1"}))


def test_a_stop_is_reported_in_the_phase_the_hook_calls_tell() -> None:
    from snapctl.protocol.models import Phase

    hooks = VllmHooks(
        engine=None, loop=asyncio.new_event_loop(), timeout_s=1, sleep_mode=False,
        policy="in-image", reload_digests=False,
    )  # fmt: skip
    seen = []
    for done in range(8):
        hooks.calls_done, hooks.in_call = done, False
        seen.append(hooks.phase)
        if done < 7:
            hooks.in_call = True
            seen.append(hooks.phase)
    assert seen == [
        *[Phase.PREPARE] * 10,  # canary, release, restore, canary, release and between them
        Phase.CAPTURE_BARRIER,
        Phase.RECOVERY_RESTORE_MEMORY,  # the restore after the barrier
        Phase.RECOVERY_CANARY, Phase.RECOVERY_CANARY,  # between it and the canary, and in it
        Phase.RECOVER,  # writing validated
    ]  # fmt: skip
    hooks.loop.close()


def test_precompiled_headers_are_dropped_only_from_the_temporary_directory(tmp_path: Path) -> None:
    from snapctl.launcher.vllm.worker import drop_precompiled_headers

    temp = tmp_path / "tmp"
    headers = temp / "torchinductor_root" / "precompiled_headers"
    (headers / "locks").mkdir(parents=True)
    (headers / "a.h").write_text("#include <x.h>\n")
    (headers / "a.h.gch").write_bytes(b"\0" * 100)
    (headers / "locks" / "a.lock").write_text("")
    elsewhere = tmp_path / "cache"
    elsewhere.mkdir()
    (elsewhere / "b.h.gch").write_bytes(b"\0" * 10)

    assert drop_precompiled_headers(elsewhere, temp) == 0
    assert (elsewhere / "b.h.gch").exists()
    assert drop_precompiled_headers(headers, temp) == 100
    assert sorted(p.name for p in headers.rglob("*")) == ["a.h", "a.lock", "locks"]
    assert drop_precompiled_headers(headers, temp) == 0


def test_memory_options_are_taken_out_and_checked() -> None:
    argv = ["/m", "--snapctl-memory-policy", "reload", "--snapctl-reload-digests", "--port", "1"]
    assert split_memory_options(argv) == (["/m", "--port", "1"], MemoryOptions("reload", True))
    assert split_memory_options(["/m", "--snapctl-memory-policy=in-image"]) == (
        ["/m"], MemoryOptions("in-image", False),
    )  # fmt: skip
    assert split_memory_options(["/m"]) == (["/m"], MemoryOptions(None, False))
    with pytest.raises(UsageError, match="must be one of auto, in-image, reload"):
        split_memory_options(["/m", "--snapctl-memory-policy", "lazy"])
    with pytest.raises(UsageError, match="needs the reload policy"):
        split_memory_options(
            ["/m", "--snapctl-memory-policy", "in-image", "--snapctl-reload-digests"]
        )


class FakeEngine:
    """vLLM's engine client as the hooks use it: every call recorded, in order."""

    def __init__(self, reloaded: dict[str, str] | None = None) -> None:
        self.calls: list[str] = []
        self.loaded = {"w": "a" * 64, "e": "b" * 64}
        self.reloaded = dict(self.loaded) if reloaded is None else reloaded

    async def collective_rpc(self, method: str, args: tuple[object, ...] = ()) -> list[object]:
        self.calls.append(f"rpc {method}{list(args) if args else ''}")
        if method == "snapctl_loaded_digests":
            return [self.loaded]
        if method == "snapctl_reload_weights":
            return [self.reloaded if args and args[0] else {}]
        return [0]

    def __getattr__(self, name: str) -> object:
        async def call(*args: object, **kwargs: object) -> None:
            shown = [*map(str, args), *(f"{k}={v}" for k, v in kwargs.items())]
            self.calls.append(f"{name}({', '.join(shown)})")

        return call


@contextmanager
def running_hooks(
    engine: FakeEngine, policy: MemoryPolicy, *, digests: bool = False
) -> Iterator[VllmHooks]:
    """Hooks on a sleep-mode platform, their loop running in a thread as the server's does;
    the loop stopped and closed afterwards."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield VllmHooks(
            engine, loop, timeout_s=10, sleep_mode=True, policy=policy, reload_digests=digests
        )
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_in_image_recovery_reloads_and_hashes_nothing() -> None:
    engine = FakeEngine()
    with running_hooks(engine, "in-image") as hooks:
        hooks.release_memory()
        hooks.restore_memory()
        hooks.release_memory()
        assert hooks.capture_facts() == CaptureFacts(
            memory_policy="in-image", parameter_digests=engine.loaded
        )
        engine.calls.clear()
        hooks.restore_memory()  # a copy's recovery
    assert engine.calls == ["reset_prefix_cache()", "resume_generation()"]


def test_first_load_digests_are_read_once_before_the_capture() -> None:
    engine = FakeEngine()
    with running_hooks(engine, "in-image") as hooks:
        hooks.release_memory()
        hooks.restore_memory()
        hooks.release_memory()
    assert engine.calls == [
        "rpc snapctl_loaded_digests", "rpc snapctl_share_memory", "pause_generation(mode=wait)",
        "rpc snapctl_drop_compile_caches", "reset_prefix_cache()", "resume_generation()",
        "pause_generation(mode=wait)", "rpc snapctl_drop_compile_caches",
    ]  # fmt: skip


@pytest.mark.parametrize("digests", [False, True])
def test_reload_recovery_sleeps_wakes_and_reloads(digests: bool) -> None:
    engine = FakeEngine()
    with running_hooks(engine, "reload", digests=digests) as hooks:
        hooks.release_memory()
        engine.calls.clear()
        hooks.restore_memory()
        facts = hooks.capture_facts()
    assert engine.calls == [
        "wake_up(tags=['weights'])", f"rpc snapctl_reload_weights[{digests}]",
        "wake_up(tags=['kv_cache'])", "reset_prefix_cache()", "resume_generation()",
    ]  # fmt: skip
    assert (facts.memory_policy, facts.reload_digests) == ("reload", digests)


def test_reload_digests_that_differ_fail_the_recovery_before_it_resumes() -> None:
    engine = FakeEngine(reloaded={"w": "a" * 64, "e": "c" * 64})
    with running_hooks(engine, "reload", digests=True) as hooks:
        hooks.release_memory()
        with pytest.raises(CanaryMismatchError, match="1 parameter"):
            hooks.restore_memory()
    assert "resume_generation()" not in engine.calls
