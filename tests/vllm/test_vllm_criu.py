"""Real vLLM end to end: ``snapctl qualify`` of ``python -m snapctl.launcher.vllm serve``.

Every test runs twice: on the tiny model, then on one of real shape (half a GB of weights). One
plain qualification (reference, donor, CRIU restore fault, two copies after the donor is gone,
recovery fault, stale control, CRIU dump fault) captures each model's one image; the lazy
qualification and the ``openai`` client test restore that image again, so each model starts
cold only three times (two references and one donor). Each run's wall time is printed
(``-s``) so CI's logs keep the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapctl.qualification.report import Report
from snapctl.qualification.watch import HOST_SHM
from snapctl.statedir import StateDir
from tests.containers import Placeholder
from tests.qualification.criu_helpers import assert_nothing_left
from tests.vllm.conftest import ROOT, VLLM_ENV, VLLM_ENV_OPTIONS, RealVllm

pytestmark = [pytest.mark.criu, pytest.mark.vllm]

API_KEY = "vllm-test-key"
SNAPCTL = ROOT / ".venv" / "bin" / "snapctl"
QUALIFY_TIMEOUT_S = 1200  # the whole plain qualification (about 2.5 min on an idle machine)


@dataclass(frozen=True)
class Qualified:
    returncode: int
    report: Report
    image: Path
    state: StateDir
    shm_before: set[str]
    report_dir: Path


def _snapctl(args: list[str], state: StateDir, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **VLLM_ENV, SNAPCTL_STATE_DIR=str(state.root), SNAPCTL_VLLM_KEY=API_KEY)
    started = time.monotonic()
    done = subprocess.run(
        [str(SNAPCTL), *args], env=env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    print(f"snapctl {args[0]}: exit {done.returncode} in {time.monotonic() - started:.1f} s")
    return done


def bake(served: RealVllm, state: StateDir, image: Path, *server_options: str) -> None:
    """``snapctl bake`` of the bridge serving ``served`` with the test's API key."""
    baked = _snapctl(
        ["bake", "--json", "--image", str(image), "--api-key-env", "SNAPCTL_VLLM_KEY",
         *VLLM_ENV_OPTIONS,
         "--timeout", "600", "--", *served.serve_command("--api-key", API_KEY, *server_options)],
        state, 1200,
    )  # fmt: skip
    assert baked.returncode == 0, baked.stderr[-3000:]


def _qualify(vllm: RealVllm, state: StateDir, image: Path, *extra: str) -> tuple[int, Report]:
    done = _snapctl(
        ["qualify", "--json", "--image", str(image), "--api-key-env", "SNAPCTL_VLLM_KEY",
         *VLLM_ENV_OPTIONS,
         "--timeout", "600", *extra, "--", *vllm.serve_command("--api-key", API_KEY)],
        state, QUALIFY_TIMEOUT_S,
    )  # fmt: skip
    assert done.stdout.strip(), done.stderr[-3000:]
    return done.returncode, Report.model_validate_json(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def qualified(served: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> Qualified:
    root = tmp_path_factory.mktemp("vllm")
    state = StateDir(root / "state")
    shm_before = set(os.listdir(HOST_SHM))
    returncode, report = _qualify(served, state, root / "image", "--report", str(root / "report"))
    return Qualified(returncode, report, root / "image", state, shm_before, root / "report")


def _unpassed(report: Report) -> list[str]:
    return [
        f"{run.name}: {check.name}: {check.status}: {check.evidence}"
        for run in report.runs
        for check in run.checks
        if check.status != "passed"
    ]


@pytest.mark.timeout(QUALIFY_TIMEOUT_S + 60)
def test_plain_qualification_passes_every_check(qualified: Qualified) -> None:
    assert _unpassed(qualified.report) == []  # none failed, none skipped: digests included
    assert qualified.returncode == 0
    names = [run.name for run in qualified.report.runs]
    assert names == [
        "reference", "donor", "criu-restore-fault", "copy-1", "copy-2", "fault",
        "stale-files", "stale-replay", "criu-dump-fault",
    ]  # fmt: skip
    for run in qualified.report.runs:
        print(run.name, run.timings.model_dump(exclude_none=True))
    checks = {(run.name, check.name) for run in qualified.report.runs for check in run.checks}
    assert ("copy-2", "parameter digests = image's first load") in checks
    assert ("fault", "fault injected in the copy's memory") in checks
    assert_nothing_left(qualified.state, qualified.shm_before)


def test_an_in_image_recovery_reads_no_weights_file(qualified: Qualified) -> None:
    """vLLM's CPU platform keeps its weights in the image: a copy's recovery only empties the
    prefix cache and resumes (its log names every step it took)."""
    for run in ("copy-1", "copy-2"):
        log = (qualified.report_dir / "runs" / run / "logs" / "server.log").read_text()
        restored = [line for line in log.splitlines() if "snapctl: memory restored" in line]
        assert restored, f"{run}: no 'memory restored' line in its server log"
        recovery = restored[-1]  # the copy's own, after the donor's rehearsal
        assert "(in-image): reset prefix cache" in recovery and "reload" not in recovery


@pytest.mark.timeout(QUALIFY_TIMEOUT_S + 60)
def test_lazy_copies_qualify_from_the_same_image(served: RealVllm, qualified: Qualified) -> None:
    assert qualified.image.is_dir(), "the plain qualification published no image"
    returncode, report = _qualify(
        served, qualified.state, qualified.image, "--lazy", "--runs", "copy-1,copy-2,lazy-fault"
    )
    assert _unpassed(report) == []
    assert returncode == 0
    assert [run.name for run in report.runs] == ["reference", "copy-1", "copy-2", "lazy-fault"]
    assert_nothing_left(qualified.state, qualified.shm_before)


@pytest.fixture
def copies(qualified: Qualified) -> Iterator[list[str]]:
    """A plain and a lazy copy of the image, published on loopback; their base URLs."""
    names: list[str] = []
    try:
        urls = []
        for index, lazy in enumerate(("--no-lazy", "--lazy")):
            name = f"vllm-openai-{index}"
            port = 18470 + index
            done = _snapctl(
                ["copy", "--image", str(qualified.image), "--name", name, "--detach", lazy,
                 "--publish", f"127.0.0.1:{port}", "--api-key-env", "SNAPCTL_VLLM_KEY"],
                qualified.state, 300,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            names.append(name)
            urls.append(f"http://127.0.0.1:{port}/v1")
        yield urls
    finally:
        for name in names:
            stopped = _snapctl(["stop", name], qualified.state, 120)
            assert stopped.returncode == 0, stopped.stderr
            assert "cleanup: clean" in stopped.stdout + stopped.stderr


@pytest.mark.timeout(600)
def test_openai_client_gets_equal_answers_from_plain_and_lazy_copies(
    served: RealVllm, copies: list[str]
) -> None:
    """The copies serve one after the other (the lazy one's figures are then its own)."""
    import openai

    def ask(client: openai.OpenAI, prompt: str) -> tuple[str, list[int], list[float]]:
        answer = client.completions.create(
            model=str(served.model), prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        token_ids = list(getattr(choice, "token_ids", None) or [])
        return choice.text, token_ids, [float(x) for x in choice.logprobs.token_logprobs]

    prompts = [f"Request {i} of a pair" for i in range(4)]
    answers = []
    for url in copies:
        client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        with ThreadPoolExecutor(max_workers=4) as pool:  # concurrent requests
            batch = list(pool.map(lambda p, c=client: ask(c, p), prompts))
        stream = client.completions.create(
            model=str(served.model), prompt=prompts[0], max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed == batch[0][0]
        answers.append(batch)
    plain, lazy = answers
    for (text, ids, logprobs), (lazy_text, lazy_ids, lazy_logprobs) in zip(
        plain, lazy, strict=True
    ):
        assert (lazy_text, lazy_ids) == (text, ids) and ids
        assert max(abs(a - b) for a, b in zip(logprobs, lazy_logprobs, strict=True)) <= 1e-3


# The openai client's greedy completion of argv[2] from the server at argv[1], as JSON.
ASK_OPENAI = """
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[3], max_retries=0, timeout=120)
choice = client.completions.create(
    model=sys.argv[4], prompt=sys.argv[2], max_tokens=8, temperature=0, logprobs=0,
    extra_body={"return_token_ids": True, "ignore_eos": True},
).choices[0]
print(json.dumps([choice.text, list(getattr(choice, "token_ids", None) or []),
                  [float(x) for x in choice.logprobs.token_logprobs]]))
"""


@pytest.mark.podman
@pytest.mark.timeout(900)
def test_a_copy_into_a_placeholder_container_answers_as_a_copy_on_the_host(
    served: RealVllm, qualified: Qualified, placeholder: Callable[..., Placeholder]
) -> None:
    """The bridge restored inside a placeholder container (the pattern of a Kubernetes pod
    that a restore fills), plainly and lazily: the same completion, token ids and log
    probabilities as a plain copy on the host, asked on the container's own loopback."""
    box = placeholder()
    answers = []
    copies = (("vllm-host", 18480, (), "--no-lazy"),
              ("vllm-in-box", 18481, (box.name,), "--no-lazy"),
              ("vllm-lazy-in-box", 18482, (box.name,), "--lazy"))  # fmt: skip
    for name, port, where, lazy in copies:
        done = _snapctl(
            ["copy", "--image", str(qualified.image), "--name", name, "--detach", lazy,
             "--publish", f"127.0.0.1:{port}", "--api-key-env", "SNAPCTL_VLLM_KEY", "--json",
             *(("--into-container", *where) if where else ())],
            qualified.state, 300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout)
        assert report["lazy"] is (lazy == "--lazy")
        if where:  # the server is in the container's own network namespace
            netns = os.stat(f"/proc/{report['root_pid']}/ns/net").st_ino
            assert netns == os.stat(f"/proc/{box.pid}/ns/net").st_ino
        try:
            argv = [sys.executable, "-c", ASK_OPENAI, f"http://127.0.0.1:{port}/v1",
                    "The capital of France is", API_KEY, str(served.model)]  # fmt: skip
            asked = subprocess.run(
                box.in_network(*argv) if where else argv,
                capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
            assert asked.returncode == 0, asked.stderr[-3000:]
            answers.append(json.loads(asked.stdout))
        finally:
            stopped = _snapctl(["stop", name], qualified.state, 120)
            assert stopped.returncode == 0, stopped.stderr
            assert "cleanup: clean" in stopped.stdout + stopped.stderr
    (text, ids, logprobs), *in_box = answers
    assert ids
    for box_text, box_ids, box_logprobs in in_box:  # plain, then lazy
        assert (box_text, box_ids) == (text, ids)
        assert max(abs(a - b) for a, b in zip(logprobs, box_logprobs, strict=True)) <= 1e-3
    assert box.running  # snapctl stop left the container as it was
