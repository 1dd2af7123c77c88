"""``python -m bench --vllm``: real vLLM, a cold start against snapctl copies of the same server.

Optional (it needs ``scripts/setup --vllm``): the tiny Llama served by
``python -m snapctl.launcher.vllm serve``. In one run it measures an ordinary cold start to the
first correct completion, the snapctl donor (capture-ready, dump, frozen time, image size), a
bare ``criu dump`` of the same tree at the same barrier (just before or just after snapctl's,
in turns), and plain and lazy copies of the
donor's image to their first correct completion with the per-phase split, and copies taken
from the agent's pool (one parked plain copy), each a fresh ``snapctl copy ... --detach --json``
as users run it, to the first correct completion. The donor is stopped before the copies,
which run one at a time, so no figure is of cores shared with another tree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bare, workload
from bench.agent import AgentCli
from bench.contenders import copy_phases
from bench.workload import Answer, free_port, host_connect
from snapctl.activation.copy import start_copy
from snapctl.activation.donor import start_donor
from snapctl.activation.launch import LaunchOptions, repo_root
from snapctl.activation.native import NoNativeStep
from snapctl.activation.tools import RealCriu, Tools
from snapctl.criu import CriuBinary, read_dump_stats
from snapctl.criu.stats import DumpStats
from snapctl.statedir import StateDir

TIMEOUT_S = 900.0
KV_CACHE_BYTES = 64 * 2**20
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
Say = Callable[[str], None]


@dataclass
class VllmResults:
    """Seconds unless named otherwise; copies keyed ``plain``/``lazy``/``pooled``, one
    sample per rep."""

    cold_start_s: float = 0.0
    warm_s: float = 0.0  # the same completion, asked again of the warm cold-started server
    donor: dict[str, float] = field(default_factory=dict)
    bare_dump: dict[str, float] = field(default_factory=dict)
    image_bytes: int = 0  # on disk
    # Through a registry on loopback: push and pull seconds, the working sets the pull adopted.
    new_host: dict[str, float] = field(default_factory=dict)
    copies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Frozen seconds of snapctl's and a bare dump of the same tree, one pair per launch.
    frozen_pairs: list[dict[str, float]] = field(default_factory=list)


def vllm_setup() -> tuple[Path, Path]:
    """The vLLM venv's Python and the tiny model (``scripts/setup --vllm``'s defaults)."""
    root = repo_root()
    venv = Path(os.environ.get("SNAPCTL_VLLM_VENV", root / ".venv-vllm"))
    model = Path(os.environ.get("SNAPCTL_VLLM_MODEL", root / ".models" / "tiny-llama"))
    if not (venv / "bin" / "python").exists() or not (model / "config.json").exists():
        raise SystemExit(f"bench --vllm needs {venv} and {model}: run scripts/setup --vllm")
    return venv / "bin" / "python", model


def server_argv(python: Path, model: Path, port: int = 8000) -> list[str]:
    return [
        str(python), "-m", "snapctl.launcher.vllm", "serve", str(model), "--dtype", "float32",
        "--max-model-len", "256", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--port", str(port),
    ]  # fmt: skip


def first_correct(
    port: int, model: Path, reference: Answer | None, alive: Callable[[], bool]
) -> Answer:
    extra = {"return_token_ids": True, "ignore_eos": True}
    return workload.first_correct(
        host_connect(port), reference, TIMEOUT_S, alive,
        ask=lambda connection: workload.complete(connection, str(model), extra),
    )  # fmt: skip


def run(criu: CriuBinary, work: Path, reps: int, say: Say, frozen_pairs: int = 1) -> VllmResults:
    """``frozen_pairs``: how many donors to launch, each dumped by snapctl and by a bare
    ``criu dump`` at the same barrier, taking turns at going first."""
    python, model = vllm_setup()
    os.environ.update(SERVER_ENV)  # the donor's environment, which every copy must match
    state = StateDir(work / "state")
    state.ensure()
    results = VllmResults()
    reference = cold_start(python, model, work, results, say)
    image = work / "vllm-image"
    for pair in range(frozen_pairs):
        # The first pair's donor image is the one the copies restore; later ones are dropped.
        donor_image = image if pair == 0 else work / f"vllm-image-{pair}"
        bare_first = pair % 2 == 1
        donor_s, bare_s = _donor(python, model, donor_image, criu, state, work, bare_first,
                                 results, say)  # fmt: skip
        results.frozen_pairs.append(
            {"donor": donor_s, "bare": bare_s, "donor_first": not bare_first}
        )
        if pair:
            shutil.rmtree(donor_image, ignore_errors=True)
    for rep in range(reps):
        for lazy in (False, True) if rep % 2 == 0 else (True, False):
            copy_once(python, model, image, criu, state, lazy, reference, results, say)
    pooled(model, image, state, work, reps, reference, results, say)
    _new_hosts(python, model, image, criu, state, work, reps, reference, results, say)
    shutil.rmtree(image, ignore_errors=True)
    return results


def cold_start(python: Path, model: Path, work: Path, results: VllmResults, say: Say) -> Answer:
    port = free_port()
    log = work / "cold.log"
    started = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            server_argv(python, model, port), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            env={**os.environ, **SERVER_ENV}, start_new_session=True,
        )  # fmt: skip
    try:
        answer = first_correct(port, model, None, lambda: proc.poll() is None)
        results.cold_start_s = time.monotonic() - started
        started = time.monotonic()
        first_correct(port, model, answer, lambda: proc.poll() is None)
        results.warm_s = time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(60)
    say(f"vllm cold start: first correct completion after {results.cold_start_s:.1f} s "
        f"(again, warm: {results.warm_s:.2f} s)")  # fmt: skip
    return answer


def launch_options(python: Path, model: Path) -> LaunchOptions:
    return LaunchOptions(
        server_argv=server_argv(python, model), timeout_s=TIMEOUT_S, server_timeout_s=TIMEOUT_S,
        env=dict(SERVER_ENV),
    )  # fmt: skip


class BareBeside(RealCriu):
    """snapctl's dump with a bare ``criu dump`` of the same tree just before or just after it.
    Both dump the tree at its barrier (``--leave-running`` leaves it as it was, link-remap files
    removed), each after a sync, so neither writes behind the other's dirty pages and the pair
    differs only by what snapctl adds (its post-dump copy of /dev/shm, its log level)."""

    def __init__(self, images: Path, first: bool) -> None:
        self.images, self.first = images, first
        self.frozen_s = self.wall_s = 0.0
        self.own_wall_s = 0.0  # snapctl's dump alone: the donor's "dump" includes the bare one

    def dump(
        self, criu: CriuBinary, root_pid: int, images_dir: Path, log_path: Path, *,
        external_mounts: Mapping[str, str], action_script: Path, timeout_s: float,
    ) -> DumpStats:  # fmt: skip
        if self.first:
            self._bare(criu, root_pid)
        os.sync()
        started = time.monotonic()
        stats = super().dump(
            criu, root_pid, images_dir, log_path, external_mounts=external_mounts,
            action_script=action_script, timeout_s=timeout_s,
        )  # fmt: skip
        self.own_wall_s = time.monotonic() - started
        if not self.first:
            self._bare(criu, root_pid)
        return stats

    def _bare(self, criu: CriuBinary, root_pid: int) -> None:
        os.sync()
        try:
            self.wall_s = bare.dump(criu.path, root_pid, self.images)
            self.frozen_s = read_dump_stats(self.images).frozen_time_us / 1e6
        finally:
            shutil.rmtree(self.images, ignore_errors=True)


def _donor(
    python: Path, model: Path, image: Path, criu: CriuBinary, state: StateDir, work: Path,
    bare_first: bool, results: VllmResults, say: Say,
) -> tuple[float, float]:  # fmt: skip
    """One donor; snapctl's and the bare dump's frozen seconds. The first one's figures are
    the donor's and the bare dump's figures."""
    beside = BareBeside(work / f"bare-dump-{uuid.uuid4().hex[:8]}", first=bare_first)
    session, report = start_donor(
        launch_options(python, model), image=image, force=False, criu=criu, native=NoNativeStep(),
        publish=None, state=state, progress=lambda step: None, tools=Tools(criu=beside),
    )  # fmt: skip
    try:
        assert report.dump_stats is not None
        frozen = report.dump_stats.frozen_time_us / 1e6
        if not results.donor:
            results.donor = {**report.timings_s, "dump": beside.own_wall_s, "frozen": frozen}
            results.bare_dump = {"dump": beside.wall_s, "frozen": beside.frozen_s}
            # On disk: the saved /dev/shm segments are mostly holes.
            results.image_bytes = sum(
                p.stat().st_blocks * 512 for p in image.rglob("*") if p.is_file()
            )
    finally:
        session.stop()
    say(
        f"vllm donor: capture-ready {report.timings_s['launch_to_capture_ready']:.1f} s, "
        f"frozen {frozen:.2f} s, image {results.image_bytes / 2**30:.2f} GiB; bare criu dump "
        f"{'before' if bare_first else 'after'} it: frozen {beside.frozen_s:.2f} s "
        f"(dump {beside.wall_s:.2f} s)"
    )
    return frozen, beside.frozen_s


def copy_once(
    python: Path, model: Path, image: Path, criu: CriuBinary, state: StateDir, lazy: bool,
    reference: Answer, results: VllmResults, say: Say, kind: str | None = None,
    container: tuple[str, int] | None = None,
) -> None:  # fmt: skip
    """One copy to its first correct completion, recorded under ``kind``; ``container``: the
    name and first process of a placeholder to restore it into, asked on its network."""
    marks: list[tuple[str, float]] = []
    options = launch_options(python, model)
    if container is not None:
        options.into_container = container[0]
    started = time.monotonic()
    session, report = start_copy(
        image, options, criu=criu, native=NoNativeStep(), publish=("127.0.0.1", 0), state=state,
        progress=lambda step: marks.append((step, time.monotonic())), lazy=lazy,
    )  # fmt: skip

    def ask(port: int) -> Answer:
        def work() -> Answer:
            return first_correct(port, model, reference, lambda: True)

        return work() if container is None else workload.in_netns(container[1], work)

    try:
        assert report.published is not None
        returned = time.monotonic() - started
        port = int(report.published.rsplit(":", 1)[1])
        ask(port)
        ready = time.monotonic() - started
        asked = time.monotonic()
        ask(port)
        again = time.monotonic() - asked
        if session.lazy is not None:
            session.lazy.wait(TIMEOUT_S)  # let the transfer end before the next contender
    finally:
        _, audit = session.stop()
    if not audit.clean:
        raise RuntimeError(f"snapctl copy left things behind: {audit.describe()}")
    phases = copy_phases(started, marks, report.timings_s)
    sample = {
        "ready_s": ready,
        "again_s": again,
        "returned_s": returned,
        "phases": phases,
        "validated_to_http_200": report.timings_s["validated_to_http_200"],
    }
    kind = kind or ("lazy" if lazy else "plain")
    results.copies.setdefault(kind, []).append(sample)
    say(f"vllm copy ({kind}): first correct completion after {ready:.2f} s")


def _again(port: int, model: Path, reference: Answer) -> float:
    """The same completion asked again of the copy: its warm time under the load of the
    moment, beside the warm server's from the start of the run."""
    started = time.monotonic()
    first_correct(port, model, reference, lambda: True)
    return time.monotonic() - started


def pooled(
    model: Path, image: Path, state: StateDir, work: Path, reps: int, reference: Answer,
    results: VllmResults, say: Say,
) -> None:  # fmt: skip
    """Copies through the agent from a pool of one parked plain copy, parked again (untimed)
    before each: from the command's start to the first correct completion."""
    cli = AgentCli(state, work / "agent.log")
    cli.start_agent()
    try:
        cli.snapctl("pool", "set", "--image", str(image), "--size", "1", "--no-lazy")
        for _ in range(reps):
            cli.wait_parked(image, 1, TIMEOUT_S)
            port, name = free_port(), f"vllm-pooled-{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            done = cli.snapctl("copy", "--image", str(image), "--publish", f"127.0.0.1:{port}",
                               "--name", name, "--detach", "--json")  # fmt: skip
            returned = time.monotonic() - started
            try:
                first_correct(port, model, reference, lambda: True)
                ready = time.monotonic() - started
                again = _again(port, model, reference)
            finally:
                cli.snapctl("--no-agent", "stop", name)
            report = json.loads(done.stdout)
            if report.get("from_pool") is not True:
                raise RuntimeError(f"{name} was restored for the request, not taken from the pool")
            timings = report["timings_s"]
            results.copies.setdefault("pooled", []).append({
                "ready_s": ready, "again_s": again, "returned_s": returned,
                "phases": {"command": returned, "handshake": timings["handshake"]},
                "validated_to_http_200": timings["validated_to_http_200"],
            })  # fmt: skip
            say(f"vllm copy (pooled): first correct completion after {ready:.2f} s "
                f"(command {returned:.2f} s)")  # fmt: skip
        cli.snapctl("pool", "rm", "--image", str(image))
    finally:
        cli.stop_agent()


def _new_hosts(
    python: Path, model: Path, image: Path, criu: CriuBinary, state: StateDir, work: Path,
    reps: int, reference: Answer, results: VllmResults, say: Say,
) -> None:  # fmt: skip
    """The first lazy copy on a host that pulled the image, with the working sets this host's
    copies learned (pushed with the image, adopted by the pull) against without any: pushed to
    and pulled from a registry on loopback once, then each copy on a fresh state directory
    (nothing learned, no view cached) that has the pulled sets or none, alternating."""
    from snapctl.registry.client import Reference, RegistryClient
    from snapctl.registry.pull import pull_cached
    from snapctl.registry.push import push_image
    from tests.registry.server import start_registry

    registry = start_registry(work / "registry")
    try:
        ref = Reference.parse(f"{registry.address}/bench/vllm:v1")
        client = RegistryClient(ref, plain_http=True)
        try:
            pushed = push_image(image, ref, client, views=state.views)
            say(f"vllm push: {pushed.image_bytes / 1e9:.2f} GB in {pushed.seconds:.1f} s, "
                f"working sets {pushed.working_sets}")  # fmt: skip
            puller = StateDir(work / "puller")
            puller.ensure()
            pulled = pull_cached(client, puller)
        finally:
            client.close()
        say(f"vllm pull: {pulled.seconds:.1f} s, working sets {pulled.working_sets}")
        results.new_host = {"push_s": pushed.seconds, "pull_s": pulled.seconds,
                            "sets_processes": pulled.working_sets.processes,
                            "sets_pages": pulled.working_sets.pages}  # fmt: skip
        adopted = sorted(puller.views.glob("*.touched.json"))
        for rep in range(reps):
            for with_sets in (True, False) if rep % 2 == 0 else (False, True):
                host = StateDir(work / f"host-{rep}-{int(with_sets)}")
                host.ensure()
                host.views.mkdir(mode=0o700, exist_ok=True)
                # The pull verified the image as it arrived: a new host does not hash it again.
                shutil.copytree(puller.verified, host.verified, dirs_exist_ok=True)
                for path in adopted if with_sets else []:
                    shutil.copy(path, host.views / path.name)
                kind = "new host, sets pulled" if with_sets else "new host, no sets"
                copy_once(python, model, Path(pulled.image), criu, host, True, reference, results,
                      say, kind=kind)  # fmt: skip
                shutil.rmtree(host.root, ignore_errors=True)
    finally:
        registry.stop()


def render(results: VllmResults) -> str:
    """The figures as a Markdown table, against the issue's targets."""
    lines = [
        "| what | median | target |",
        "|---|---|---|",
        f"| cold start → first correct completion | {results.cold_start_s:.1f} s | |",
        f"| donor launch → capture-ready | {results.donor.get('launch_to_capture_ready', 0):.1f} s"
        " | |",
        f"| donor dump (frozen) | {results.donor.get('dump', 0):.2f} s "
        f"({results.donor.get('frozen', 0):.2f} s) | frozen within 10 % of bare |",
        f"| bare criu dump (frozen) | {results.bare_dump.get('dump', 0):.2f} s "
        f"({results.bare_dump.get('frozen', 0):.2f} s) | |",
        f"| image size | {results.image_bytes / 2**30:.2f} GiB | |",
    ]
    if len(results.frozen_pairs) > 1:
        donor = median([pair["donor"] for pair in results.frozen_pairs])
        bare_s = median([pair["bare"] for pair in results.frozen_pairs])
        ratio = median([pair["donor"] / pair["bare"] for pair in results.frozen_pairs])
        lines.append(
            f"| donor / bare frozen, {len(results.frozen_pairs)} pairs | {donor:.2f} / "
            f"{bare_s:.2f} s (ratio {ratio:.2f}) | ≤ 1.10 |"
        )
    contenders = (("plain", "≥ 30x sooner"), ("lazy", "≥ 100x sooner"), ("pooled", ""),
                  ("new host, sets pulled", ""), ("new host, no sets", ""))  # fmt: skip
    for kind, target in contenders:
        samples = results.copies.get(kind, [])
        if not samples:
            continue
        ready = median([s["ready_s"] for s in samples])
        speedup = results.cold_start_s / ready if ready else 0.0
        each = ", ".join(f"{s['ready_s']:.2f}" for s in samples)
        lines.append(
            f"| {kind} copy → first correct completion | {ready:.2f} s ({speedup:.0f}x sooner; "
            f"{each} s) | {target} |"
        )
        for phase in samples[0]["phases"]:
            value = median([s["phases"][phase] for s in samples])
            target_text = "≤ 0.1 s" if phase == "stage" else ""
            lines.append(f"| {kind}: {phase} | {value * 1000:.0f} ms | {target_text} |")
        after = median([s["validated_to_http_200"] for s in samples])
        lines.append(f"| {kind}: validated → first 200 | {after * 1000:.0f} ms | ≤ 0.1 s |")
    if results.new_host:
        host = results.new_host
        lines.append(
            f"| new host: push, pull; working sets pulled | {host['push_s']:.1f} s, "
            f"{host['pull_s']:.1f} s; {host['sets_processes']:.0f} processes, "
            f"{host['sets_pages']:.0f} pages | |"
        )
    return "\n".join(lines) + "\n"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
