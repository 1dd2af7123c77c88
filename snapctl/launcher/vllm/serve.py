"""The two ways to run: plain ``vllm serve``, and startup capture before public serving.

Plain mode is vLLM's ``run_server``: bind, build the engine and the app, serve. Startup mode
follows #59851's ``run_startup_snapshot_server``, with one change of order: the app and its
state are built before the capture barrier, so a validated activation only binds and starts
uvicorn. The public socket is bound only after ``validated``. Every failure after the snapshot
config is read writes ``error.json`` with its phase; the engine is shut down and the process
exits without serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from argparse import Namespace
from types import FrameType
from typing import TYPE_CHECKING, Any

from snapctl.launcher.vllm import app as vllm_app
from snapctl.launcher.vllm.hooks import VllmHooks
from snapctl.launcher.vllm.usage import UsageError, require_single_frontend
from snapctl.launcher.vllm.worker import RECORD_LOAD_ENV

if TYPE_CHECKING:
    from snapctl.launcher import BindTarget
    from snapctl.launcher.vllm.memory import MemoryOptions
    from snapctl.protocol.facts import MemoryPolicy
    from snapctl.protocol.models import SnapshotConfig

# Under "vllm.", so vLLM's logging configuration (handler and format) applies.
log = logging.getLogger("vllm.snapctl")


def run(args: Namespace, snapshot_config: str | None, memory: MemoryOptions) -> int:
    import uvloop
    from pydantic import ValidationError
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    from snapctl.protocol.models import SnapshotConfig

    cli_env_setup()
    configure_logging_from_args(args)
    # Leave a blocking start on SIGTERM (PID 1 of a namespace ignores it without a handler);
    # uvicorn's own handler replaces this one once serving.
    signal.signal(signal.SIGTERM, _interrupt)
    if snapshot_config is None:
        uvloop.run(_serve_plain(args))
        return 0
    try:
        config = SnapshotConfig.model_validate_json(snapshot_config)
    except ValidationError as error:
        log.error("invalid --snapshot-config: %s", error)
        return 2
    try:
        return int(uvloop.run(_serve_after_capture(args, config, memory)))
    except KeyboardInterrupt:
        log.info("terminated before serving")
        return 0


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt("terminated")


async def _serve_plain(args: Namespace) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine:
            app = await vllm_app.build(engine, args)
            shutdown = await vllm_app.serve(app, sock, listen_address, args)
        await shutdown  # after the engine is closed, as vLLM's run_server_worker does
    finally:
        sock.close()


async def _serve_after_capture(
    args: Namespace, config: SnapshotConfig, memory: MemoryOptions
) -> int:
    from snapctl.launcher import StartupCaptureError, report_failure
    from snapctl.protocol.controldir import ControlDir
    from snapctl.protocol.models import Phase

    phase = Phase.INITIALIZE_ENGINE
    target: BindTarget | None = None
    hooks: VllmHooks | None = None
    sock = None
    try:
        require_single_frontend(args)
        # Refuse an unusable control directory before minutes of engine start, as vLLM does.
        ControlDir(config.control_dir).validate(require_empty=True)
        sleep_mode, policy = _prepare_args(args, memory)
        log.info("snapctl: memory policy %s", policy)
        # vLLM's worker, started with this environment, records the first load's digests.
        os.environ[RECORD_LOAD_ENV] = "1"
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.utils.gc_utils import freeze_gc_heap

        async with build_async_engine_client(args) as engine:
            app = await vllm_app.build(engine, args)
            # vLLM's lifespan collects and freezes the heap when uvicorn starts; done here, its
            # collection after `validated` has nothing left to walk (nor, in a lazy copy, to
            # fault in).
            freeze_gc_heap()
            hooks = VllmHooks(
                engine, asyncio.get_running_loop(), config.timeout_s, sleep_mode=sleep_mode,
                policy=policy, reload_digests=memory.reload_digests,
            )  # fmt: skip
            try:
                target = await _capture_in_thread(config, hooks)
            except StartupCaptureError as error:
                log.error("startup capture failed: %s", error)  # error.json is written
                return 1
            log.info("activation %s (%s) validated", target.activation_id, target.kind)
            validated_at = time.monotonic()
            phase = Phase.SERVE
            if target.host is not None:
                args.host = target.host
            args.port = target.port
            listen_address, sock = vllm_app.bind(args)
            log.info("bound %s %.1f ms after validated", listen_address, _ms_since(validated_at))
            watch = asyncio.create_task(_log_when_serving(app, validated_at))
            shutdown = await vllm_app.serve(app, sock, listen_address, args)
            watch.cancel()
        await shutdown
        return 0
    except (KeyboardInterrupt, asyncio.CancelledError) as stop:
        # A stop (SIGTERM) before serving is recorded like a failure, in the phase it came in,
        # as #59851 and snapctl's launcher do; the capture thread, if any, dies with the process.
        if target is None:
            stopped_in = phase if hooks is None else hooks.phase
            report_failure(config, stopped_in, stop)
        raise KeyboardInterrupt("terminated") from stop
    except BaseException as error:
        log.error("%s failed: %s: %s", phase.value, type(error).__name__, error)
        report_failure(config, phase, error, None if target is None else target.activation_id)
        return 1
    finally:
        if sock is not None:
            sock.close()


def _ms_since(start: float) -> float:
    return (time.monotonic() - start) * 1000


async def _log_when_serving(app: Any, validated_at: float) -> None:
    """Log when uvicorn has started (its ``started`` flag), as time since ``validated``."""
    while not getattr(getattr(app.state, "server", None), "started", False):
        await asyncio.sleep(0.001)
    log.info("serving %.1f ms after validated", _ms_since(validated_at))


def _prepare_args(args: Namespace, memory: MemoryOptions) -> tuple[bool, MemoryPolicy]:
    """Checks ``setup_server`` makes before binding; the memory policy (given, or chosen by the
    platform: ``reload`` where vLLM has sleep mode, else ``in-image``) and sleep mode where the
    reload policy can use it."""
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.platforms import current_platform
    from vllm.utils.system_utils import set_ulimit

    validate_api_server_args(args)
    set_ulimit()
    available = bool(current_platform.is_sleep_mode_available())
    policy = memory.policy or ("reload" if available else "in-image")
    if memory.reload_digests and policy != "reload":
        raise UsageError(
            f"--snapctl-reload-digests needs the reload policy, and this platform's is {policy}:"
            " give --snapctl-memory-policy reload too"
        )
    sleep_mode = available and policy == "reload"
    if sleep_mode:
        args.enable_sleep_mode = True
    elif getattr(args, "enable_sleep_mode", False) and not available:
        raise UsageError("--enable-sleep-mode is not supported on this platform")
    return sleep_mode, policy


async def _capture_in_thread(config: SnapshotConfig, hooks: VllmHooks) -> BindTarget:
    """Run the blocking capture protocol in a daemon thread while the loop serves the engine;
    a daemon thread, so a terminated start never waits for it."""
    from snapctl.launcher import run_startup_capture

    loop = asyncio.get_running_loop()
    done: asyncio.Future[BindTarget] = loop.create_future()

    def settle(result: BindTarget | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = run_startup_capture(config, hooks)
        except BaseException as failure:
            error = failure
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=body, name="snapctl-capture", daemon=True).start()
    return await done
