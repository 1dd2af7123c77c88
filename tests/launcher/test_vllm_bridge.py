"""The vLLM bridge's pieces that need no vLLM: its command line and the digest comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapctl.launcher.vllm.cli import EXTENSION_FLAG, split_snapshot_config, with_worker_extension
from snapctl.launcher.vllm.hooks import digest_difference
from snapctl.launcher.vllm.usage import UsageError
from snapctl.launcher.vllm.worker import EXTENSION


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
    import asyncio

    from snapctl.launcher.vllm.hooks import VllmHooks
    from snapctl.protocol.models import Phase

    hooks = VllmHooks(engine=None, loop=asyncio.new_event_loop(), timeout_s=1, sleep_mode=False)
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
