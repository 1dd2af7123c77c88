"""The warm pool with real vLLM: a parked copy of a vLLM image, activated on request, answers
the OpenAI API exactly as a copy restored for the request does (greedy, with log
probabilities), and nothing is left after both are stopped; on the tiny model and on one of
real shape."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from snapctl.pool.records import load_parked_records
from snapctl.qualification.watch import HOST_SHM
from snapctl.statedir import StateDir
from tests.agent.helpers import stop_all_clean
from tests.pool.test_pool_criu import Host
from tests.qualification.criu_helpers import assert_nothing_left
from tests.vllm.conftest import VLLM_ENV, RealVllm
from tests.vllm.test_vllm_criu import API_KEY, bake

pytestmark = [pytest.mark.criu, pytest.mark.vllm, pytest.mark.timeout(1800)]


def completion(published: str) -> tuple[str, list[float]]:
    import openai

    client = openai.OpenAI(base_url=f"http://{published}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120)  # fmt: skip
    model = client.models.list().data[0].id
    result = client.completions.create(model=model, prompt="The capital of France is",
                                       max_tokens=8, temperature=0, logprobs=1)  # fmt: skip
    choice = result.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs
    return choice.text, [round(x, 4) for x in choice.logprobs.token_logprobs if x is not None]


def test_a_parked_vllm_copy_answers_like_a_fresh_one(
    served: RealVllm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateDir(tmp_path / "state")
    image = tmp_path / "image"
    shm_before = set(os.listdir(HOST_SHM))
    bake(served, state, image)
    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
    host = Host(state)
    try:
        host.fill(image, 1, lazy=False, timeout_s=600)
        request: dict[str, Any] = {
            "image": str(image), "publish": {"port": 0}, "api_key_env": "SNAPCTL_VLLM_KEY",
            "api_key": API_KEY, "timeout_s": 600.0, "lazy": False,
        }  # fmt: skip
        pooled = host(op="copy", request={**request, "name": "vllm-pooled"})
        assert pooled["report"]["from_pool"] is True, pooled
        print(f"from the pool: {pooled['wall_s']:.3f} s", pooled["report"]["timings_s"])
        fresh = host(op="fresh", request={**request, "name": "vllm-fresh"})
        assert fresh["report"]["from_pool"] is False
        print(f"fresh supervisor: {fresh['wall_s']:.3f} s")
        assert completion(pooled["report"]["published"]) == completion(fresh["report"]["published"])
        host(op="rm", image=str(image))
        host(op="close")
    finally:
        host.kill()
    assert load_parked_records(state) == []
    stop_all_clean(state)
    assert_nothing_left(state, shm_before)
