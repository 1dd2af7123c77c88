"""The agent with real vLLM, driven by the real CLI: a copy restored for the request and one
from the pool answer the OpenAI API identically (greedy, with log probabilities), and nothing
is left once both are stopped and the agent has stopped."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from snapctl.qualification.watch import HOST_SHM
from snapctl.statedir import StateDir
from tests.agent.helpers import AgentProcess, cli, fill_pool
from tests.qualification.criu_helpers import assert_nothing_left
from tests.vllm.conftest import VLLM_ENV, VLLM_ENV_OPTIONS, RealVllm
from tests.vllm.test_vllm_criu import API_KEY, _snapctl
from tests.vllm.test_vllm_pool_criu import completion

pytestmark = [pytest.mark.criu, pytest.mark.vllm, pytest.mark.timeout(1800)]


def test_vllm_copies_through_the_agent_fresh_and_from_the_pool_answer_alike(
    vllm: RealVllm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = StateDir(tmp_path / "state")
    image = tmp_path / "image"
    shm_before = set(os.listdir(HOST_SHM))
    baked = _snapctl(
        ["--no-agent", "bake", "--json", "--image", str(image), *VLLM_ENV_OPTIONS, "--api-key-env",
         "SNAPCTL_VLLM_KEY", "--timeout", "600", "--", *vllm.serve_command("--api-key", API_KEY)],
        state, 1200,
    )  # fmt: skip
    assert baked.returncode == 0, baked.stderr[-3000:]
    for key, value in {**VLLM_ENV, "SNAPCTL_VLLM_KEY": API_KEY}.items():
        monkeypatch.setenv(key, value)
    agent = AgentProcess(state)
    try:
        args = ["copy", "--image", str(image), "--publish", "127.0.0.1:0", "--api-key-env",
                "SNAPCTL_VLLM_KEY", "--timeout", "600", "--no-lazy", "--detach",
                "--json"]  # fmt: skip
        fresh = json.loads(cli(state, *args, "--name", "vllm-fresh", timeout=900).stdout)
        assert fresh["from_pool"] is False
        fill_pool(state, image, timeout_s=900)
        pooled = json.loads(cli(state, *args, "--name", "vllm-pooled", timeout=900).stdout)
        assert pooled["from_pool"] is True
        print("fresh", fresh["timings_s"], "pooled", pooled["timings_s"])
        assert completion(pooled["published"]) == completion(fresh["published"])
        for name in ("vllm-fresh", "vllm-pooled"):
            stopped = json.loads(cli(state, "stop", name, "--json").stdout)
            assert not any(stopped["audit"].values()), stopped
        cli(state, "pool", "rm", "--image", str(image))
    finally:
        agent.kill(signal.SIGTERM)
    assert agent.process.returncode == 0, agent.log.read_text()[-3000:]
    assert_nothing_left(state, shm_before)
