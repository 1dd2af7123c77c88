"""The startup hooks on vLLM's engine, with #59851's semantics and a memory policy
(:mod:`snapctl.protocol.facts`).

The canary is vLLM's own: one greedy token of a fixed private prompt through the engine, with
its log probability. Under the ``in-image`` policy (the default where vLLM has no sleep mode, as
on its CPU platform) the weights stay in memory through the capture and come back with the
image's pages: a recovery reads no weights file and hashes nothing, it only empties the prefix
cache and resumes. Under ``reload`` (the default where sleep mode exists: #59851's policy) the
weights are released with ``sleep(level=2)`` (where the platform has it) and every recovery
wakes them, reloads them from their files and wakes the KV cache; with ``reload_digests`` it
also compares the sha256 of every reloaded parameter, computed in the worker, with the first
load's, so a changed weights file fails closed even where one changed weight would move the
canary by less than its tolerance.

Either way the first load's digests are taken once, before the capture, from what the worker
recorded while vLLM loaded the weights, and stated in the capture facts.

The hooks are called from the capture thread (:func:`snapctl.launcher.run_startup_capture`
blocks); each runs its coroutine on the server's event loop and waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from snapctl.errors import CanaryMismatchError, SnapctlError
from snapctl.protocol.facts import CaptureFacts, MemoryPolicy
from snapctl.protocol.models import Oracle, Phase

CANARY_PROMPT = "The capital of France is"  # vLLM's own (vllm/snapshot/engine.py)
CANARY_REQUEST_ID = "vllm-snapshot-canary"

T = TypeVar("T")

# Under "vllm.", so vLLM's logging configuration (handler and format) applies.
log = logging.getLogger("vllm.snapctl")

# run_startup_capture calls the hooks in a fixed order: canary, release, restore, canary, release
# (prepare), then, after the barrier, restore and canary (recovery). The phase of each call:
HOOK_PHASES = (Phase.PREPARE,) * 5 + (Phase.RECOVERY_RESTORE_MEMORY, Phase.RECOVERY_CANARY)
# ... and of the time after the n-th call has returned, from the third last call on.
AFTER_HOOK_PHASES = {5: Phase.CAPTURE_BARRIER, 6: Phase.RECOVERY_CANARY, 7: Phase.RECOVER}


class CanaryError(SnapctlError, RuntimeError):
    """The canary did not return exactly one token with its log probability."""


class VllmHooks:
    """``snapctl.launcher.StartupHooks`` on an ``EngineClient`` (vLLM's ``AsyncLLM``)."""

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        *,
        sleep_mode: bool,
        policy: MemoryPolicy,
        reload_digests: bool,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.timeout_s = timeout_s
        # Sleep mode only serves the reload policy: in-image weights must stay where they are.
        self.sleep_mode = sleep_mode and policy == "reload"
        self.policy: MemoryPolicy = policy
        self.reload_digests = reload_digests and policy == "reload"
        self.loaded_digests: dict[str, str] | None = None
        self.calls_done = 0
        self.in_call = False

    @property
    def phase(self) -> Phase:
        """The protocol phase the capture is in, as far as the hook calls tell: what a stop
        from outside (SIGTERM) reports in error.json, as the capture itself would."""
        if self.in_call:
            return HOOK_PHASES[min(self.calls_done, len(HOOK_PHASES) - 1)]
        return AFTER_HOOK_PHASES.get(min(self.calls_done, 7), Phase.PREPARE)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        bounded = asyncio.wait_for(coroutine, self.timeout_s)
        self.in_call = True
        try:
            return asyncio.run_coroutine_threadsafe(bounded, self.loop).result()
        finally:
            self.in_call = False
            self.calls_done += 1

    def canary(self) -> Oracle:
        started = time.monotonic()
        oracle = self._run(run_canary(self.engine))
        log.info("snapctl: canary %.1f ms", (time.monotonic() - started) * 1e3)
        return oracle

    def release_memory(self) -> None:
        self._run(self._release())

    def restore_memory(self) -> None:
        self._run(self._restore())

    def capture_facts(self) -> CaptureFacts:
        assert self.loaded_digests is not None  # taken by the first release
        return CaptureFacts(
            memory_policy=self.policy,
            reload_digests=self.reload_digests,
            parameter_digests=self.loaded_digests,
        )

    async def _release(self) -> None:
        if self.loaded_digests is None:
            started = time.monotonic()
            self.loaded_digests = await loaded_digests(self.engine)
            log.info("snapctl: first load's digests %.1f ms", (time.monotonic() - started) * 1e3)
            if self.policy == "in-image":
                # Copies of the image then share the weights' pages where the host runs ksmd.
                (shared,) = await self.engine.collective_rpc("snapctl_share_memory")
                log.info("snapctl: memory mergeable by KSM: %s", "yes" if shared else "no")
        await self.engine.pause_generation(mode="wait")
        if self.sleep_mode:
            await self.engine.sleep(level=2)
        # Out of the image, which every restore would unpack: a compile cache in /tmp.
        await self.engine.collective_rpc("snapctl_drop_compile_caches")

    async def _restore(self) -> None:
        steps: dict[str, float] = {}

        async def step(name: str, call: Awaitable[T]) -> T:
            started = time.monotonic()
            try:
                return await call
            finally:
                steps[name] = (time.monotonic() - started) * 1e3

        if self.policy == "reload":
            await self._reload(step)
        # Nothing cached before the capture may answer a request after it.
        await step("reset prefix cache", self.engine.reset_prefix_cache())
        await step("resume", self.engine.resume_generation())
        log.info(
            "snapctl: memory restored (%s): %s",
            self.policy,
            ", ".join(f"{k} {v:.1f} ms" for k, v in steps.items()),
        )

    async def _reload(self, step: Callable[[str, Awaitable[Any]], Awaitable[Any]]) -> None:
        """The reload policy: the weights read from their files again (and, with
        ``reload_digests``, the reloaded parameters' digests compared with the first load's)."""
        if self.sleep_mode:
            await step("wake weights", self.engine.wake_up(tags=["weights"]))
        what = "reload weights and digests" if self.reload_digests else "reload weights"
        (digests,) = await step(
            what, self.engine.collective_rpc("snapctl_reload_weights", args=(self.reload_digests,))
        )
        if self.sleep_mode:
            await step("wake kv cache", self.engine.wake_up(tags=["kv_cache"]))
        if self.reload_digests:
            assert self.loaded_digests is not None
            difference = digest_difference(self.loaded_digests, _by_name(digests))
            if difference is not None:
                raise CanaryMismatchError(
                    f"the reloaded weights differ from the first load: {difference}"
                )


async def run_canary(engine: Any) -> Oracle:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, min_tokens=1, max_tokens=1, seed=0, logprobs=0)
    final = None
    async for output in engine.generate(CANARY_PROMPT, params, request_id=CANARY_REQUEST_ID):
        final = output
    if final is None:
        raise CanaryError("the canary generation returned no output")
    try:
        candidate = final.outputs[0]
        (token_id,) = candidate.token_ids
        logprob = float(candidate.logprobs[0][token_id].logprob)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
        raise CanaryError("the canary did not return one token with its logprob") from error
    return Oracle(
        token_ids=[int(token_id)], text=str(candidate.text), sampled_token_logprob=logprob
    )


async def parameter_digests(engine: Any) -> dict[str, str]:
    """The worker's parameter digests, of the weights as its kernels hold them now (one
    worker: local single-rank execution)."""
    (digests,) = await engine.collective_rpc("snapctl_parameter_digests")
    return _by_name(digests)


async def loaded_digests(engine: Any) -> dict[str, str]:
    """The first load's parameter digests, as the worker recorded them while loading."""
    (digests,) = await engine.collective_rpc("snapctl_loaded_digests")
    return _by_name(digests)


def _by_name(digests: dict[Any, Any]) -> dict[str, str]:
    return {str(name): str(value) for name, value in digests.items()}


def digest_difference(expected: dict[str, str], got: dict[str, str]) -> str | None:
    if expected.keys() != got.keys():
        missing = sorted(expected.keys() - got.keys())[:3]
        extra = sorted(got.keys() - expected.keys())[:3]
        return f"parameters missing {missing}, unexpected {extra}"
    changed = sorted(name for name in expected if expected[name] != got[name])
    if changed:
        return f"{len(changed)} parameter(s) changed, first {changed[0]}"
    return None
