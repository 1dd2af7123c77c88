"""``python -m bench.agent``: the CLI as a user runs it, in-process against through the agent.

Side by side, in one run, each timed from the command's start to the first correct completion
on the published port (a fresh ``snapctl copy ... --detach --json`` process each time):

- ``in-process``: ``snapctl --no-agent copy`` (today's CLI; lazy by default from 256 MiB);
- ``agent plain`` / ``agent lazy``: through the agent, no pool (``--no-lazy`` / ``--lazy``);
- ``agent pool``: through the agent with ``pool set --size 1``: the copy is parked already
  (the pool refills between repetitions, untimed).

Then 16 concurrent copy requests to the agent with a pool of 4 (all served, none lost, how many
from the pool, and the pool refilled), and ``snapctl ps`` wall time through the agent and
in-process. Needs root and CRIU; about a quarter of an hour with the default sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.machine import compile_bytecode, machine
from bench.workload import Answer, ColdServer, ensure_model, first_correct, free_port, host_connect
from bench.workload import launch_options as fixture_options
from snapctl.activation.donor import start_donor
from snapctl.activation.launch import repo_root
from snapctl.activation.native import NoNativeStep
from snapctl.criu import find_criu
from snapctl.statedir import StateDir

# The console script, as users run it (python -m snapctl would add runpy).
SNAPCTL = [str(Path(sys.executable).parent / "snapctl")]
MODES = ("in-process", "agent plain", "agent lazy", "agent pool")


def say(message: str) -> None:
    print(f"bench.agent: {message}", file=sys.stderr, flush=True)


class AgentCli:
    """The console script against one state directory, and the agent serving it."""

    def __init__(self, state: StateDir, log: Path) -> None:
        self.state = state
        self.log = log
        self.env = {**os.environ, "SNAPCTL_STATE_DIR": str(self.state.root),
                    "PYTHONPATH": str(repo_root())}  # fmt: skip
        self.env.pop("SNAPCTL_NO_AGENT", None)
        self.env.pop("SNAPCTL_AGENT_SOCKET", None)
        self.agent: subprocess.Popen[bytes] | None = None

    def snapctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*SNAPCTL, *args], env=self.env, capture_output=True, text=True,
                              check=check, cwd=repo_root())  # fmt: skip

    def start_agent(self, *, share_memory: bool = False) -> None:
        """``snapctl agent``; the host's KSM only with ``share_memory`` (what the model-size
        benchmark measures), never for the others' figures."""
        sharing = "--share-memory" if share_memory else "--no-share-memory"
        with self.log.open("ab") as log:
            self.agent = subprocess.Popen([*SNAPCTL, "agent", sharing], env=self.env, stdout=log,
                                          stderr=log, cwd=repo_root())  # fmt: skip
        deadline = time.monotonic() + 60
        while not (self.state.root / "agent.sock").exists():
            if self.agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not start (see {self.log})")
            time.sleep(0.05)

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            self.agent.wait(120)
        self.agent = None

    def wait_parked(self, image: Path, count: int, timeout_s: float = 300.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            listing = json.loads(self.snapctl("pool", "ls", "--json").stdout)
            for entry in listing["entries"]:
                if entry["target"]["image"] == str(image):
                    ready = [row for row in entry["parked"] if row["state"] == "parked"]
                    if len(ready) >= count:
                        return time.monotonic() - started
            time.sleep(0.1)
        raise RuntimeError(f"the pool did not park {count} copies of {image} in {timeout_s} s")


class Bench(AgentCli):
    def __init__(
        self, work: Path, sizes: list[int], reps: int, *, requests: int = 16, pool: int = 4
    ) -> None:
        super().__init__(StateDir(work / "state"), work / "agent.log")
        self.work = work
        self.requests, self.pool = requests, pool
        self.sizes = sizes
        self.reps = reps
        self.reference: Answer | None = None
        self.samples: dict[str, dict[int, list[float]]] = {m: {} for m in MODES}
        self.sources: dict[str, list[bool]] = {}
        self.results: dict[str, Any] = {}
        self.reports: dict[str, dict[int, list[dict[str, float]]]] = {}
        # Seconds until the command returned (its report printed), before the completion.
        self.cli_exit: dict[str, dict[int, list[float]]] = {}

    def capture(self, size_mb: int) -> Path:
        path = self.work / "images" / f"retained-{size_mb}mb"
        say(f"capturing an image with {size_mb} MB retained")
        session, _ = start_donor(
            fixture_options(size_mb), image=path, force=True, criu=find_criu(),
            native=NoNativeStep(), publish=None, state=self.state, progress=lambda _: None,
            activate_donor=False,
        )  # fmt: skip
        session.stop()
        return path

    def copy(self, image: Path, *flags: str) -> tuple[float, dict[str, Any]]:
        """One CLI copy: seconds from its start to the first correct completion, its report.
        ``--no-agent`` in ``flags`` goes before the command, the rest after."""
        port = free_port()
        name = f"b-{uuid.uuid4().hex[:8]}"
        before = [flag for flag in flags if flag == "--no-agent"]
        after = [flag for flag in flags if flag != "--no-agent"]
        started = time.monotonic()
        done = self.snapctl(
            *before,
            "copy",
            "--image",
            str(image),
            "--publish",
            f"127.0.0.1:{port}",
            "--name",
            name,
            "--detach",
            "--json",
            *after,
        )
        report: dict[str, Any] = json.loads(done.stdout)
        report["_cli_s"] = time.monotonic() - started
        first_correct(host_connect(port), self.reference, 120.0)
        return time.monotonic() - started, report

    def stop(self, name: str) -> None:
        self.snapctl("--no-agent", "stop", name)

    # -- measurements ----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        ensure_model(self.state)
        self.start_agent()
        try:
            self.measure_ps()
            for size in self.sizes:
                image = self.capture(size)
                if self.reference is None:
                    server = ColdServer(self.state, size, self.work / "reference.log")
                    try:
                        self.reference = first_correct(
                            host_connect(server.port), None, 300.0, server.alive
                        )
                    finally:
                        server.stop()
                self.measure_copies(image, size)
                if size != self.sizes[0]:
                    self.snapctl("image", "rm", str(image), check=False)
            if self.requests:  # --requests 0: no concurrent round
                self.measure_concurrent(
                    self.work / "images" / f"retained-{self.sizes[0]}mb", self.requests, self.pool
                )
        finally:
            self.stop_agent()
        return {"machine": machine(find_criu().version).model_dump(), "results": self.results,
                "samples": self.samples, "timings_s": self.reports}  # fmt: skip

    def measure_ps(self, reps: int = 15) -> None:
        def wall(*args: str) -> float:
            started = time.monotonic()
            subprocess.run(args, env=self.env, capture_output=True, check=True)
            return time.monotonic() - started

        snapctl = str(Path(sys.executable).parent / "snapctl")
        figures = {
            "python -c pass": [wall(sys.executable, "-c", "pass") for _ in range(reps)],
            "snapctl ps (agent)": [wall(snapctl, "ps") for _ in range(reps)],
            "snapctl ps --json (agent)": [wall(snapctl, "ps", "--json") for _ in range(reps)],
            "snapctl --no-agent ps": [wall(snapctl, "--no-agent", "ps") for _ in range(reps)],
        }
        self.results["ps_wall_s"] = {k: summary(v) for k, v in figures.items()}
        for key, value in self.results["ps_wall_s"].items():
            say(f"{key}: median {value['median']:.3f} s (min {value['min']:.3f})")

    def measure_copies(self, image: Path, size: int) -> None:
        """The three modes without a pool target (so nothing is taken from a pool), rotated
        per repetition; then the pool's, its copy parked again before each repetition."""
        flags = {
            "in-process": ("--no-agent",),
            "agent plain": ("--no-lazy",),
            "agent lazy": ("--lazy",),
            "agent pool": (),
        }
        unpooled = [mode for mode in MODES if mode != "agent pool"]
        for mode in unpooled:  # untimed warm-up: page cache, verification cache
            _, report = self.copy(image, *flags[mode])
            self.stop(report["name"])
        for rep in range(self.reps):
            for mode in unpooled[rep % len(unpooled) :] + unpooled[: rep % len(unpooled)]:
                self.sample(image, size, mode, flags[mode], rep)
        # Parked plain: a parked copy has its time to take every page in before it is asked for.
        self.snapctl("pool", "set", "--image", str(image), "--size", "1", "--no-lazy")
        say(f"{size} MB: first copy parked after {self.wait_parked(image, 1):.2f} s")
        for rep in range(self.reps):
            self.wait_parked(image, 1)
            self.sample(image, size, "agent pool", flags["agent pool"], rep)
        self.snapctl("pool", "rm", "--image", str(image))
        self.results.setdefault("copy_first_correct_s", {})[size] = {
            mode: summary(self.samples[mode][size]) for mode in MODES
        }
        self.results.setdefault("command_s", {})[size] = {
            mode: summary(self.cli_exit[mode][size]) for mode in MODES
        }
        self.results.setdefault("from_pool", {})[size] = {
            mode: sum(self.sources[mode][-self.reps :]) for mode in MODES
        }

    def sample(self, image: Path, size: int, mode: str, flags: tuple[str, ...], rep: int) -> None:
        seconds, report = self.copy(image, *flags)
        self.stop(report["name"])
        self.samples[mode].setdefault(size, []).append(seconds)
        self.cli_exit.setdefault(mode, {}).setdefault(size, []).append(report["_cli_s"])
        self.sources.setdefault(mode, []).append(bool(report.get("from_pool")))
        self.reports.setdefault(mode, {}).setdefault(size, []).append(report["timings_s"])
        say(f"{size} MB rep {rep + 1}: {mode}: {seconds:.3f} s (command {report['_cli_s']:.3f} s; "
            "from_pool "
            f"{report.get('from_pool')}; phases {_phases(report['timings_s'])})")  # fmt: skip

    def measure_concurrent(self, image: Path, requests: int = 16, pool: int = 4) -> None:
        self.snapctl("pool", "set", "--image", str(image), "--size", str(pool), "--no-lazy")
        self.wait_parked(image, pool)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=requests) as executor:
            outcomes = list(executor.map(lambda _: self._try_copy(image), range(requests)))
        total = time.monotonic() - started
        served = [report for ok, _, report in outcomes if ok]
        refill_s = self.wait_parked(image, pool)
        for report in served:
            self.stop(report["name"])
        self.snapctl("pool", "rm", "--image", str(image))
        self.results["concurrent"] = {
            "requests": requests, "pool": pool, "served": len(served),
            "from_pool": sum(1 for report in served if report.get("from_pool")),
            "total_s": round(total, 3),
            "per_request_s": summary([seconds for ok, seconds, _ in outcomes if ok]),
            "refilled_after_s": round(refill_s, 3),
            "errors": [str(report) for ok, _, report in outcomes if not ok],
        }  # fmt: skip
        say(f"concurrent: {self.results['concurrent']}")

    def _try_copy(self, image: Path) -> tuple[bool, float, Any]:
        try:
            seconds, report = self.copy(image)
            return True, seconds, report
        except Exception as error:
            return False, 0.0, error


def _phases(timings: dict[str, float]) -> str:
    return " ".join(f"{name}={seconds * 1000:.0f}ms" for name, seconds in timings.items())


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}  # fmt: skip


def table(results: dict[str, Any]) -> str:
    lines = ["| size | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for size, row in results["copy_first_correct_s"].items():
        cells = [f"{row[m]['median']:.3f} s" for m in MODES]
        lines.append(f"| {size} MiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextmanager
def workdir(base: Path, keep: bool) -> Iterator[Path]:
    path = base / f"snapctl-bench-agent-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700, parents=True)
    try:
        yield path
    finally:
        if not keep:
            subprocess.run([*SNAPCTL, "--no-agent", "gc"], env={
                **os.environ, "SNAPCTL_STATE_DIR": str(path / "state")}, capture_output=True,
                check=False)  # fmt: skip
            subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agent", description=__doc__)
    parser.add_argument("--sizes", default="64,512,2048", help="retained MB, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--work-dir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--requests", type=int, default=16, help="concurrent copy requests (0: none)"
    )
    parser.add_argument("--pool", type=int, default=4, help="pool size for --requests")
    args = parser.parse_args(argv)
    sizes = [int(part) for part in args.sizes.split(",")]
    compile_bytecode()
    with workdir(args.work_dir, args.keep) as work:
        results = Bench(work, sizes, args.reps, requests=args.requests, pool=args.pool).run()
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    print(table(results["results"]))
    print(json.dumps(results["results"], indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
