"""``python -m bench --vllm --model-sizes tiny,0.5,2.9``: what a copy costs as the model grows.

For each size (GB of float32 weights; ``tiny`` is the tests' model) a Llama of that shape is
written once (``scripts/llama_model.py``, deterministic, kept in the models directory), then,
in one run and one size at a time: the cold start to the first correct completion and the same
completion asked again of that warm server; ``snapctl bake``'s launch → capture-ready and the
image's size on disk; the first lazy copies, which learn the image's working sets on this host;
then plain and lazy copies (in turns) and copies from the agent's pool, each to the first
correct completion, with its handshake, and plain copies restored into a placeholder container
(where podman is installed), beside the plain copies on the host; a bare ``criu restore`` of
the same image to the barrier; and the PSS of one and of three parked copies. What a copy adds
is its time to the first correct completion less the warm completion's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import bare, vllm
from bench.agent import AgentCli
from bench.workload import Answer
from snapctl.activation.donor import start_donor
from snapctl.activation.launch import repo_root
from snapctl.activation.native import NoNativeStep
from snapctl.criu import CriuBinary
from snapctl.criu.lazy.tuning import WORKING_SET_MIN_GROWTH
from snapctl.criu.lazy.workingset import read_runs
from snapctl.pool.records import load_parked_records
from snapctl.registry.workingsets import image_pagemaps
from snapctl.statedir import StateDir
from snapctl.supervision.memory import read_ksm, tree_memory

TINY = "tiny"
# The most lazy copies the benchmark makes to learn an image's working sets.
LEARN_MAX_COPIES = 6
KSM_SETTLE_TIMEOUT_S = 300.0
KSM_STEADY_S = 10.0


@dataclass
class SizeResults:
    """One model size's figures (seconds, bytes); copies keyed plain/lazy/pooled, and
    IN_PLACEHOLDER for plain copies into a placeholder container."""

    size: str
    weights_bytes: int = 0
    cold_start_s: float = 0.0
    warm_completion_s: float = 0.0
    capture_ready_s: float = 0.0
    image_bytes: int = 0
    bare_restore_s: list[float] = field(default_factory=list)
    copies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # "1" and "3" parked copies; "merge_N_s": how long KSM took to settle after they parked
    pss_bytes: dict[str, int] = field(default_factory=dict)


def parse_sizes(text: str) -> list[str]:
    sizes = [part.strip() for part in text.split(",") if part.strip()]
    for size in sizes:
        if size != TINY and not float(size) > 0:
            raise ValueError(f"a model size is 'tiny' or GB of weights, not {size!r}")
    return sizes


def model_for(size: str, python: Path, models: Path, say: vllm.Say) -> Path:
    """The model directory for ``size``, written once (the same bytes every time)."""
    if size == TINY:
        return vllm.vllm_setup()[1]
    directory = models / f"llama-{size}gb"
    if not (directory / "config.json").exists():
        say(f"writing a {size} GB Llama into {directory}")
        subprocess.run(
            [str(python), str(repo_root() / "scripts" / "llama_model.py"), str(directory),
             "--weights-gb", size], check=True,
        )  # fmt: skip
    return directory


def run(
    criu: CriuBinary, work: Path, models: Path, sizes: list[str], reps: int, say: vllm.Say
) -> list[SizeResults]:
    python, _ = vllm.vllm_setup()
    os.environ.update(vllm.SERVER_ENV)
    found = []
    for size in sizes:
        model = model_for(size, python, models, say)
        found.append(_one_size(criu, work / f"size-{size}", python, model, size, reps, say))
    return found


def _one_size(
    criu: CriuBinary, work: Path, python: Path, model: Path, size: str, reps: int, say: vllm.Say
) -> SizeResults:
    work.mkdir(parents=True)
    state = StateDir(work / "state")
    state.ensure()
    results = SizeResults(size=size, weights_bytes=_weights_bytes(model))
    measured = vllm.VllmResults()
    reference = vllm.cold_start(python, model, work, measured, say)
    results.cold_start_s, results.warm_completion_s = measured.cold_start_s, measured.warm_s
    image = work / "image"
    session, report = start_donor(
        vllm.launch_options(python, model), image=image, force=False, criu=criu,
        native=NoNativeStep(), publish=None, state=state, progress=lambda step: None,
        activate_donor=False,
    )  # fmt: skip
    session.stop()
    results.capture_ready_s = report.timings_s["launch_to_capture_ready"]
    results.image_bytes = sum(p.stat().st_blocks * 512 for p in image.rglob("*") if p.is_file())
    say(f"{size}: capture-ready {results.capture_ready_s:.1f} s (cold start "
        f"{results.cold_start_s:.1f} s), image {results.image_bytes / 1e9:.2f} GB")  # fmt: skip
    _learn_working_sets(python, model, image, criu, state, reference, measured, say)
    with placeholder(say) as box:
        for rep in range(reps):
            for lazy in (False, True) if rep % 2 == 0 else (True, False):
                vllm.copy_once(python, model, image, criu, state, lazy, reference, measured, say)
            if box is not None:
                # Beside a plain copy on the host: what restoring into a container adds.
                vllm.copy_once(python, model, image, criu, state, False, reference, measured,
                               say, kind=IN_PLACEHOLDER, container=box)  # fmt: skip
            results.bare_restore_s.append(_bare_restore(criu, image, work))
    vllm.pooled(model, image, state, work, reps, reference, measured, say)
    results.copies = measured.copies
    results.pss_bytes = _parked_pss(image, state, work, say)
    shutil.rmtree(image, ignore_errors=True)
    return results


# As the tests' placeholders: runc (crun refuses hybrid cgroup hosts), the host's files as
# its root, no network of its own to reach (the copy is asked inside its namespace).
PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager=cgroupfs")
IN_PLACEHOLDER = "plain-in-placeholder"


@contextlib.contextmanager
def placeholder(say: vllm.Say) -> Iterator[tuple[str, int] | None]:
    """A running placeholder container (``sleep infinity``), its name and first process; None
    where podman is not installed (the row is then left out). Removed by its name after."""
    if shutil.which("podman") is None:
        say("podman is not installed: no copies into a placeholder")
        yield None
        return
    name = f"snapctl-bench-placeholder-{uuid.uuid4().hex[:8]}"
    try:
        subprocess.run(
            [*PODMAN, "run", "--detach", "--name", name, "--network", "none",
             "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000",
             "--rootfs", "/:O", "sleep", "infinity"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        pid = subprocess.run(
            [*PODMAN, "inspect", "--format", "{{.State.Pid}}", name],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout.strip()  # fmt: skip
        yield name, int(pid)
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "1", name],
                       capture_output=True, timeout=120, check=False)  # fmt: skip


def _learn_working_sets(
    python: Path, model: Path, image: Path, criu: CriuBinary, state: StateDir,
    reference: Answer, measured: vllm.VllmResults, say: vllm.Say,
) -> None:  # fmt: skip
    """Lazy copies until the host's working sets of the image stop growing (the first lazy
    copies of an image on a host learn what a copy touches: docs/lazy.md), each timed as
    ``lazy-learning``; the ``lazy`` samples after them are the steady state."""
    learned = _learned_pages(image, state)
    for _ in range(LEARN_MAX_COPIES):
        vllm.copy_once(python, model, image, criu, state, True, reference, measured, say,
                       kind="lazy-learning")  # fmt: skip
        before, learned = learned, _learned_pages(image, state)
        if learned - before <= before * WORKING_SET_MIN_GROWTH:
            return


def _learned_pages(image: Path, state: StateDir) -> int:
    sets = [read_runs(state.views, key) for key in image_pagemaps(image)]
    return sum(learned.page_count for learned in sets if learned is not None)


def _learning(samples: list[dict[str, Any]]) -> str:
    if not samples:
        return "-"
    times = ", ".join(f"{s['ready_s']:.2f}" for s in samples)
    return f"{times} s ({len(samples)} copies until the working sets stopped growing)"


def _pss(pss: dict[str, int]) -> str:
    one, three = pss.get("1", 0), pss.get("3", 0)
    return (f"{one / 1e9:.2f} / {three / 1e9:.2f} GB ({three / max(one, 1):.2f}x; KSM settled "
            f"in {pss.get('merge_3_s', 0)} s)")  # fmt: skip


def _weights_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def _bare_restore(criu: CriuBinary, image: Path, work: Path) -> float:
    """A bare ``criu restore`` of the image, to the tree waiting at its barrier."""
    started = time.monotonic()
    copy = bare.restore_tree(criu.path, image, work / f"bare-{uuid.uuid4().hex[:8]}")
    seconds = time.monotonic() - started
    copy.stop()
    return seconds


def _parked_pss(image: Path, state: StateDir, work: Path, say: vllm.Say) -> dict[str, int]:
    """The PSS of one, then of three parked plain copies of the image, all counted, each once
    the host's KSM (which the agent starts) has merged them; and how long that took."""
    cli = AgentCli(state, work / "pss-agent.log")
    cli.start_agent(share_memory=True)
    found: dict[str, int] = {}
    try:
        for count in (1, 3):
            cli.snapctl("pool", "set", "--image", str(image), "--size", str(count), "--no-lazy")
            cli.wait_parked(image, count, vllm.TIMEOUT_S)
            found[f"merge_{count}_s"] = int(_merged(KSM_SETTLE_TIMEOUT_S))
            trees = [tree_memory(record.root_pid, record.root_start_time)
                     for _, record in load_parked_records(state)
                     if record is not None and record.root_pid is not None]  # fmt: skip
            found[str(count)] = sum(tree.pss_bytes or 0 for tree in trees if tree is not None)
            say(f"PSS of {count} parked: {found[str(count)] / 1e9:.2f} GB "
                f"(KSM settled in {found[f'merge_{count}_s']} s)")  # fmt: skip
        cli.snapctl("pool", "rm", "--image", str(image))
    finally:
        cli.stop_agent()
    return found


def _merged(timeout_s: float) -> float:
    """Wait until KSM has merged what it can: three full scans more than now (the first may
    have begun before the copies existed) and pages shared steady for
    :data:`KSM_STEADY_S`; the seconds waited (0 where KSM is stopped)."""
    started = time.monotonic()
    first = read_ksm()
    if first is None or not first.running:
        return 0.0
    sharing, steady_since = first.pages_sharing, started
    while time.monotonic() - started < timeout_s:
        time.sleep(1)
        now = read_ksm()
        if now is None:
            break
        if now.pages_sharing != sharing:
            sharing, steady_since = now.pages_sharing, time.monotonic()
        scanned = now.full_scans >= first.full_scans + 3
        if scanned and time.monotonic() - steady_since >= KSM_STEADY_S:
            break
    return time.monotonic() - started


def render(found: list[SizeResults], reps: int) -> str:
    """One table: a column per size, medians of ``reps``."""
    header = "| | " + " | ".join(f"{r.size} ({r.weights_bytes / 1e9:.2f} GB)" for r in found)
    lines = [header + " |", "|---|" + "---|" * len(found)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("cold start → first correct completion", [f"{r.cold_start_s:.1f} s" for r in found])
    row("the same completion, warm server", [f"{r.warm_completion_s:.2f} s" for r in found])
    row("launch → capture-ready (x cold start)",
        [f"{r.capture_ready_s:.1f} s ({r.capture_ready_s / r.cold_start_s:.2f}x)"
         for r in found])  # fmt: skip
    row("image on disk", [f"{r.image_bytes / 1e9:.2f} GB" for r in found])
    row("bare criu restore", [f"{vllm.median(r.bare_restore_s):.2f} s" for r in found])
    for kind in ("plain", IN_PLACEHOLDER, "lazy", "pooled"):
        cells = []
        for r in found:
            samples = r.copies.get(kind, [])
            if not samples:
                cells.append("-")
                continue
            ready = vllm.median([s["ready_s"] for s in samples])
            adds = ready - r.warm_completion_s
            handshake = vllm.median([s["phases"].get("handshake", 0.0) for s in samples])
            again = vllm.median([s.get("again_s", 0.0) for s in samples])
            cells.append(f"{ready:.2f} s (adds {adds:.2f} s; handshake {handshake * 1e3:.0f} ms;"
                         f" {r.cold_start_s / ready:.0f}x sooner; asked again "
                         f"{again:.2f} s)")  # fmt: skip
        named = (
            "plain copy into a placeholder container" if kind == IN_PLACEHOLDER else f"{kind} copy"
        )
        row(f"{named} → first correct completion", cells)
        if kind == "plain":
            row("first lazy copies, learning what a copy touches",
                [_learning(r.copies.get("lazy-learning", [])) for r in found])  # fmt: skip
    row("PSS of 1 / 3 parked copies", [_pss(r.pss_bytes) for r in found])
    lines.append(f"\nMedians of {reps}; seconds from the command's start.")
    return "\n".join(lines) + "\n"
