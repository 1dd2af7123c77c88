"""The measurement plan: side by side, interleaved repetitions (the contenders' order rotates
every repetition, so a burst of load from a neighbour hits each of them alike), all samples
kept, targets judged as ratios of medians measured in this one run."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TypeVar

from bench import bare
from bench.contenders import ColdStart, Context, Image, Sample
from bench.machine import MIB, cli_commands, image_files, machine, read_rates
from bench.plan import Plan
from bench.results import Results, Settings
from bench.tally import Recorder, judge_targets
from bench.workload import Answer, ColdServer, ensure_model, first_correct, host_connect
from bench.workload import launch_options as fixture_options
from snapctl.activation.copy import start_copies, start_copy
from snapctl.activation.core import ActivationReport, new_session
from snapctl.activation.donor import start_donor
from snapctl.activation.launch import (
    fixture_command,
    launch_in_sandbox,
    repo_root,
    snapshot_config_arg,
    wait_capture_ready,
)
from snapctl.activation.native import NoNativeStep
from snapctl.activation.session import Session
from snapctl.criu import find_criu, read_dump_stats
from snapctl.images import verify_image
from snapctl.statedir import StateDir
from snapctl.supervision.process import become_subreaper

T = TypeVar("T")
Say = Callable[[str], None]
# The donor pause's contenders; "-v4" is bare CRIU at debug level (what the dump log costs).
DONOR_CONTENDERS = ("snapctl donor", "bare CRIU dump", "bare CRIU dump -v4")


def rotated(items: Sequence[T], rep: int) -> list[T]:
    shift = rep % len(items)
    return [*items[shift:], *items[:shift]]


class Runner:
    """Runs a :class:`Plan` in a scratch directory and returns :class:`Results`."""

    def __init__(self, plan: Plan, work: Path, say: Say) -> None:
        self.plan = plan
        self.work = work
        self.say = say
        self.rec = Recorder()
        self.state = StateDir(work / "state")
        self.images = work / "images"
        self.scratch = work / "scratch"
        self.criu = find_criu()
        self.ctx = Context(state=self.state, criu=self.criu, scratch=self.scratch)
        self.reference: Answer | None = None
        self.failures: list[str] = []
        self._images: dict[int, Image] = {}

    # -- setup ------------------------------------------------------------------------------

    def attempt(self, what: str, run: Callable[[], T]) -> T:
        """Run one timed start; a failure is recorded and retried once (a shared, loaded host
        fails now and then), a second failure ends the run."""
        try:
            return run()
        except Exception as error:
            self.failures.append(f"{what}: {type(error).__name__}: {error}")
            self.say(f"failed, retrying once: {self.failures[-1]}")
            return run()

    def image(self, size_mb: int) -> Image:
        """A published image of the fixture retaining ``size_mb`` (captured once per run)."""
        if size_mb in self._images:
            return self._images[size_mb]
        path = self.images / f"retained-{size_mb}mb"
        self.say(f"capturing an image with {size_mb} MB retained")
        self.capture(size_mb, path, force=True)
        image = Image(size_mb, path, sum(p.stat().st_size for p in image_files(path)))
        self._images[size_mb] = image
        return image

    def capture(self, size_mb: int, path: Path, *, force: bool) -> ActivationReport:
        """Publish an image of the fixture retaining ``size_mb`` at ``path``; the donor is only
        captured, never activated, and is stopped before this returns."""
        session, report = start_donor(
            fixture_options(size_mb), image=path, force=force, criu=self.criu,
            native=NoNativeStep(), publish=None, state=self.state, progress=lambda _: None,
            activate_donor=False,
        )  # fmt: skip
        session.stop()
        return report

    def drop_image(self, size_mb: int) -> None:
        image = self._images.pop(size_mb, None)
        if image is not None:
            shutil.rmtree(image.path, ignore_errors=True)

    def run(self) -> Results:
        started = time.monotonic()
        for path in (self.images, self.scratch):
            path.mkdir(parents=True, exist_ok=True)
        ensure_model(self.state)
        # Restored trees are reparented to the nearest subreaper: the bare baseline reaps its own.
        become_subreaper()
        env_machine = machine(self.criu.version)
        self.measure_cli()
        self.measure_copies()
        self.measure_concurrency()
        self.measure_donor_pause()
        for size in list(self._images):
            self.drop_image(size)
        return Results(
            machine=env_machine,
            settings=Settings(
                quick=self.plan.quick,
                sizes_mb=self.plan.sizes_mb,
                reps=self.plan.reps,
                concurrency_mb=self.plan.concurrency_mb,
                concurrency=self.plan.concurrency,
                donor_sizes_mb=self.plan.donor_sizes_mb,
                donor_reps=self.plan.donor_reps,
                cli_reps=self.plan.cli_reps,
                contenders=[c.name for c in self.plan.contenders],
                at_once_sizes_mb=self.plan.at_once_sizes_mb,
                at_once_reps=self.plan.at_once_reps,
            ),
            figures=self.rec.figures(),
            targets=judge_targets(self.rec, self.plan),
            failures=self.failures,
            wall_s=round(time.monotonic() - started, 3),
        )

    # -- 6. CLI start ---------------------------------------------------------------------------

    def measure_cli(self) -> None:
        commands = cli_commands()
        env = {**os.environ, "PYTHONPATH": str(repo_root())}
        self.say(f"CLI start: {self.plan.cli_reps} x {len(commands)} commands")
        for rep in range(self.plan.cli_reps):
            for name in rotated(list(commands), rep):
                started = time.monotonic()
                subprocess.run(
                    commands[name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env=env, cwd=repo_root(), check=True,
                )  # fmt: skip
                self.rec.add("cli_start_s", name, None, time.monotonic() - started, "s")

    # -- 1, 2, 4, 5. restores against a cold start -----------------------------------------------

    def warm_reference(self, size_mb: int) -> Answer:
        """The correct completion, from one cold start (untimed): every contender must match."""
        log = self.scratch / "reference.log"
        server = ColdServer(self.state, size_mb, log)
        try:
            return first_correct(host_connect(server.port), None, 300.0, server.alive)
        finally:
            server.stop()

    def measure_copies(self) -> None:
        contenders = self.plan.contenders
        for size in self.plan.sizes_mb:
            image = self.image(size)
            if self.reference is None:
                self.reference = self.warm_reference(size)
            # Untimed warm-up: page cache, snapctl's verification cache, Python imports.
            for contender in contenders:
                if not isinstance(contender, ColdStart):
                    contender.run(self.ctx, image, self.reference)
            for rep in range(self.plan.reps):
                cached, fresh = read_rates(image.path)
                self.rec.add("read_MBps", "page cache -> reused buffer", size, cached, "MB/s")
                self.rec.add("read_MBps", "page cache -> fresh memory", size, fresh, "MB/s")
                for contender in rotated(contenders, rep):
                    sample = self.attempt(
                        f"{contender.name} {size} MB",
                        partial(contender.run, self.ctx, image, self.reference),
                    )
                    self.say(
                        f"{size} MB rep {rep + 1}/{self.plan.reps}: {contender.name}: "
                        f"ready {sample.ready_s:.3f} s"
                    )
                    self.record_sample(contender.name, image, sample)
            if size in self.plan.at_once_sizes_mb:
                self.measure_at_once(image)
            if size != self.plan.concurrency_mb:
                self.drop_image(size)

    def record_sample(self, name: str, image: Image, sample: Sample) -> None:
        size, add = image.size_mb, self.rec.add
        add("ready_s", name, size, sample.ready_s, "s")
        if sample.validated_s is not None:
            add("validated_s", name, size, sample.validated_s, "s")
        for phase, seconds in sample.phases.items():
            add(f"phase:{phase}", name, size, seconds, "s")
        for phase, seconds in sample.after.items():
            add(f"after:{phase}", name, size, seconds, "s")
        if sample.criu_restore_s is not None:
            add("criu_restore_time_s", name, size, sample.criu_restore_s, "s")
        if sample.pages_complete_s is not None:
            add("pages_complete_s", name, size, sample.pages_complete_s, "s")
        if sample.pages_present_s is not None:
            add("pages_present_s", name, size, sample.pages_present_s, "s")
        if sample.daemon_ready_s is not None:
            add("lazy_pages_ready_s", name, size, sample.daemon_ready_s, "s")
        if "criu" in sample.phases and sample.all_pages_restored:
            add("restore_MBps", name, size, image.criu_bytes / MIB / sample.phases["criu"], "MB/s")
        if sample.handshake_s is not None:
            add("handshake_ms", name, size, sample.handshake_s * 1000, "ms")
        if sample.recovery_s is not None:
            add("server_recovery_ms", name, size, sample.recovery_s * 1000, "ms")

    # -- 7. concurrency ---------------------------------------------------------------------

    def measure_concurrency(self) -> None:
        image = self.image(self.plan.concurrency_mb)
        for rep in range(self.plan.reps):
            for count in rotated(self.plan.concurrency, rep):
                total, per_copy = self.attempt(
                    f"{count} copies at once",
                    partial(self.copies_at_once, image, count),
                )
                for seconds in per_copy:
                    self.rec.add(
                        "concurrent_per_copy_s", f"{count} at once", image.size_mb, seconds, "s"
                    )
                self.rec.add("concurrent_total_s", f"{count} at once", image.size_mb, total, "s")
                self.say(f"{count} copies at once ({image.size_mb} MB): {total:.3f} s")

    def copies_at_once(self, image: Image, count: int) -> tuple[float, list[float]]:
        """``start_copies``: all ready (s), and each copy's own ``timings_s`` sum."""
        started = time.monotonic()
        results = start_copies(
            image.path, fixture_options(image.size_mb), count, criu=self.criu,
            native=NoNativeStep(), publish_base=None, state=self.state,
            progress_for=lambda label: lambda step: None,
        )  # fmt: skip
        total = time.monotonic() - started
        per_copy = []
        for result in results:
            if isinstance(result, tuple):
                session, report = result
                session.stop()
                per_copy.append(sum(report.timings_s.values()))
        failures = [r for r in results if not isinstance(r, tuple)]
        if failures:
            raise RuntimeError(f"{len(failures)} of {count} copies failed: {failures[0]}")
        return total, per_copy

    # -- 8. plain and lazy copies started together -------------------------------------------

    def measure_at_once(self, image: Image) -> None:
        modes = {"snapctl copy": False, "snapctl copy --lazy": True}
        runs = [(name, count) for name in modes for count in self.plan.concurrency]
        for rep in range(self.plan.at_once_reps):
            for name, count in rotated(runs, rep):
                label = f"{name}, {count} at once"
                per_copy = self.attempt(
                    f"{label} ({image.size_mb} MB)",
                    partial(self.first_correct_at_once, image, count, lazy=modes[name]),
                )
                for first, present in per_copy:
                    self.rec.add("at_once_ready_s", label, image.size_mb, first, "s")
                    self.rec.add("at_once_pages_present_s", label, image.size_mb, present, "s")
                self.say(
                    f"{image.size_mb} MB {label}: first correct "
                    + ", ".join(f"{first:.3f}" for first, _ in per_copy)
                    + " s; all pages "
                    + ", ".join(f"{present:.3f}" for _, present in per_copy)
                    + " s"
                )

    def first_correct_at_once(
        self, image: Image, count: int, *, lazy: bool
    ) -> list[tuple[float, float]]:
        """``count`` copies started together as ``start_copies`` starts them (one verification,
        then one ``start_copy`` per thread), each sending its first completion as soon as its
        own start returned. Per copy: seconds from the common start to its first correct
        completion and to every page of it present (plain: its ``criu restore`` returned;
        lazy: its daemon exited 0). All copies are stopped only once every one is complete."""
        verify_image(image.path, cache_dir=self.state.verified)
        sessions: list[Session] = []
        started = time.monotonic()

        def one(index: int) -> tuple[float, float]:
            marks: list[tuple[str, float]] = []
            session, report = start_copy(
                image.path, fixture_options(image.size_mb), criu=self.criu,
                native=NoNativeStep(), publish=("127.0.0.1", 0), state=self.state,
                progress=lambda step: marks.append((step, time.monotonic())), lazy=lazy,
            )  # fmt: skip
            sessions.append(session)
            assert report.published is not None
            port = int(report.published.rsplit(":", 1)[1])
            first_correct(host_connect(port), self.reference, self.ctx.timeout_s)
            first = time.monotonic() - started
            restoring = dict(marks)["restoring with CRIU"] - started
            if session.lazy is None:
                return first, restoring + report.timings_s["restore"]
            status = session.lazy.wait(self.ctx.timeout_s)
            if status.state != "complete" or status.complete_s is None:
                raise RuntimeError(f"copy {index + 1}: lazy pages did not complete: {status}")
            return first, restoring + status.complete_s

        try:
            with ThreadPoolExecutor(max_workers=count) as pool:
                futures = [pool.submit(one, index) for index in range(count)]
                return [future.result() for future in futures]
        finally:
            audits = [session.stop()[1] for session in sessions]
            dirty = [audit.describe() for audit in audits if not audit.clean]
            if dirty:
                raise RuntimeError(f"copies left things behind: {dirty[0]}")

    # -- 3. donor pause ---------------------------------------------------------------------

    def measure_donor_pause(self) -> None:
        ways: dict[str, Callable[[int], tuple[float, float]]] = {
            "snapctl donor": self.snapctl_donor,
            "bare CRIU dump": partial(self.bare_dump, verbose=False),
            "bare CRIU dump -v4": partial(self.bare_dump, verbose=True),
        }
        for size in self.plan.donor_sizes_mb:
            for rep in range(self.plan.donor_reps):
                for which in rotated(list(DONOR_CONTENDERS), rep):
                    measure = ways[which]
                    frozen, wall = self.attempt(f"{which} {size} MB", partial(measure, size))
                    self.rec.add("frozen_s", which, size, frozen, "s")
                    self.rec.add("dump_s", which, size, wall, "s")
                    self.say(f"donor {size} MB: {which}: frozen {frozen:.3f} s (dump {wall:.3f} s)")

    def snapctl_donor(self, size_mb: int) -> tuple[float, float]:
        path = self.scratch / f"donor-{uuid.uuid4().hex[:8]}"
        try:
            report = self.capture(size_mb, path, force=False)
            assert report.dump_stats is not None
            return report.dump_stats.frozen_time_us / 1e6, report.timings_s["dump"]
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def bare_dump(self, size_mb: int, verbose: bool) -> tuple[float, float]:
        """The same tree, launched the same way, dumped by raw CRIU without snapctl."""
        options = fixture_options(size_mb)
        session = new_session(self.state, "donor", None)
        images = self.scratch / f"dump-{uuid.uuid4().hex[:8]}"
        try:
            argv, cwd = fixture_command(options, self.state)
            argv = [*argv, "--snapshot-config", snapshot_config_arg(options.server_timeout_s)]
            session.launcher, session.root = launch_in_sandbox(
                argv, cwd, session.dirs, options, dict(os.environ)
            )
            wait_capture_ready(session.dirs, session.root, options.timeout_s)
            wall = bare.dump(self.criu.path, session.root.pid, images, verbose)
            return read_dump_stats(images).frozen_time_us / 1e6, wall
        finally:
            session.stop()
            shutil.rmtree(images, ignore_errors=True)


@contextmanager
def workdir(base: Path | None, keep: bool) -> Iterator[Path]:
    """A fresh scratch directory (0700), removed afterwards unless ``keep``."""
    root = Path(base) if base else Path("/tmp")
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"snapctl-bench-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
