"""vLLM's OpenAI app and its state, built ahead of binding, then served on a given socket.

:func:`build` makes exactly what vLLM's ``build_and_serve`` makes (``build_app`` and
``init_app_state``) plus two debug routes qualification reads; :func:`serve` binds and hands the
app to vLLM's ``serve_http`` with ``build_and_serve``'s options. In startup mode the build runs
before the capture barrier, so a validated activation only binds and starts uvicorn.
"""

from __future__ import annotations

import logging
import socket
from argparse import Namespace
from typing import Any

from snapctl.launcher.vllm.hooks import parameter_digests

DIGESTS_PATH = "/v1/debug/param-digests"
RETAINED_PATH = "/v1/debug/retained-digest"


async def build(engine: Any, args: Namespace) -> Any:
    """vLLM's app with its state initialised and the debug routes added (nothing bound)."""
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks)

    async def param_digests() -> JSONResponse:
        return JSONResponse(await parameter_digests(engine))

    async def retained_digest() -> JSONResponse:
        (payload,) = await engine.collective_rpc("snapctl_retained_digest")
        return JSONResponse(payload)

    # Under /v1, so vLLM's --api-key middleware guards them like every other /v1 route.
    app.add_api_route(DIGESTS_PATH, param_digests, methods=["GET"])
    app.add_api_route(RETAINED_PATH, retained_digest, methods=["GET"])
    _preload_uvicorn()
    return app


def _preload_uvicorn() -> None:
    """Import the protocol modules uvicorn loads on start, so none is imported after release."""
    import uvicorn.lifespan.on
    import uvicorn.protocols.http.auto
    import uvicorn.protocols.websockets.auto  # noqa: F401


def bind(args: Namespace) -> tuple[str, socket.socket]:
    """The listening socket at ``args.host``/``args.port``, as vLLM's ``setup_server`` makes it."""
    from vllm.entrypoints.launchers.launcher import create_server_socket

    sock = create_server_socket((args.host or "", args.port), reuse_port=False)
    scheme = "https" if args.ssl_keyfile and args.ssl_certfile else "http"
    return f"{scheme}://{args.host or '0.0.0.0'}:{args.port}", sock


async def serve(app: Any, sock: socket.socket, listen_address: str, args: Namespace) -> Any:
    """Serve ``app`` on ``sock`` until the server stops, with ``build_and_serve``'s uvicorn
    options; return the shutdown to await once the engine is closed (as vLLM does)."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    extra: dict[str, Any] = {}
    log_config = get_uvicorn_log_config(args)
    if log_config is not None:
        extra["log_config"] = log_config
    logging.getLogger("vllm.snapctl").info("Starting vLLM server on %s", listen_address)
    return await serve_http(
        app,
        sock=sock,
        enable_ssl_refresh=args.enable_ssl_refresh,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        h11_max_header_count=args.h11_max_header_count,
        **extra,
    )
