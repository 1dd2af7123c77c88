"""Chaos: SIGKILL snapctl (and/or its detached supervisor) at random instants of its commands,
then run one ``snapctl gc`` and count what is left.

Each kill runs one command of :data:`COMMANDS` as a real CLI process (``donor``, ``bake``,
``copy``, ``copy --lazy``, ``image import``, foreground or ``--detach``), waits a seeded random
delay within that command's calibrated window, notes which window the command was in (from
what it had created so far), and SIGKILLs the process, its process group, or the process and
its detached supervisor. Then: leftovers (processes, mounts, /dev/shm files, netns, staging
directories, .tmp records, activations), one ``gc --json``, leftovers again, every image
verified (no corrupt or half-published one), and every few kills a fresh copy that must serve.

A stop round (:meth:`Driver.stop_once`) kills only the command of a detached start, named, at
a random instant, then runs ``snapctl stop NAME`` right after and one ``gc``: whatever the
start had reached, nothing may be left (no process, record, reservation or mount).

The driver makes itself a child subreaper and reaps nothing until gc has run, as a PID 1 that
never reaps would: a killed supervisor stays a zombie, and everything a killed command left
running is reparented here, so "processes left" is exactly the driver's living descendants.

``tests/test_chaos_criu.py`` runs a short, seeded round in CI; for the measurement run it
longer (as root, from the repository root)::

    .venv/bin/python -m tests.chaos --kills 200 --stops 40 --seed 21 --out chaos.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from snapctl.images import verify_image
from snapctl.namespaces import mounts
from snapctl.statedir.names import read_holder

API_KEY = "chaos-key"
API_KEY_ENV = "SNAPCTL_CHAOS_API_KEY"
PR_SET_CHILD_SUBREAPER = 36
KEY = ("--api-key-env", API_KEY_ENV)
PUBLISH = ("--publish", "127.0.0.1:0")


@dataclass(frozen=True)
class Command:
    """One command under test: its argv (``{image}`` filled in per run) and what may be
    killed along with it."""

    name: str
    argv: tuple[str, ...]
    new_image: bool  # it publishes an image of its own (to be verified after the kill)
    detachable: bool


COMMANDS = (
    Command("donor", ("donor", "--image", "{image}", *KEY, *PUBLISH), True, True),
    Command("bake", ("bake", "--image", "{image}", *KEY), True, False),
    Command("copy", ("copy", "--image", "{base}", "--no-lazy", *KEY, *PUBLISH), False, True),
    Command("copy --lazy", ("copy", "--image", "{base}", "--lazy", *KEY, *PUBLISH), False, True),
    Command("image import", ("image", "import", "{archive}", "--to", "{image}"), True, False),
)
KILL_MODES = ("process", "group", "process+supervisor")
STOP_MODE = "process, then stop NAME"
LEFTOVER_GLOBS = (".*.staging-*", ".*.replaced-*")


@dataclass
class Kill:
    """One kill and what it left, before and after one gc."""

    index: int
    command: str
    mode: str
    detach: bool
    delay_s: float
    window: str
    exited_before_kill: bool
    hit: bool  # something was killed (not a command that had already exited, alone)
    before_gc: dict[str, int]
    after_gc: dict[str, int]
    gc_status: int
    # Activations whose supervisor was not killed (still supervised: not leftovers), and how
    # many of them gc stopped though it must not have.
    supervised_survivors: int = 0
    gc_killed_supervised: int = 0
    after_gc_detail: list[str] = field(default_factory=list)
    corrupt_images: list[str] = field(default_factory=list)
    next_copy: str | None = None  # None: not tried this time; "ok" or why it failed
    # A stop round's ``snapctl stop NAME``: how it stopped, "no activation" (the command was
    # killed before anything was started under the name), or why it failed; None otherwise.
    stop: str | None = None


class Driver:
    """Runs kills in ``root`` (state dir, images, archive), all seeded by ``seed``."""

    def __init__(self, root: Path, seed: int, *, next_copy_every: int = 4) -> None:
        self.root = root
        self.state = root / "state"
        self.images = root / "images"
        self.base = self.images / "base"
        self.archive = root / "base.tar.zst"
        self.rng = random.Random(seed)
        self.next_copy_every = next_copy_every
        self.windows: dict[str, float] = {}
        # A detached start's time from its name's reservation to its report (calibrated).
        self.start_spans: dict[str, float] = {}
        self.kills: list[Kill] = []
        self.shm_baseline = set(os.listdir("/dev/shm"))
        # What this process ran before the round (a test session's fixtures: a registry, say)
        # is not the round's: never counted, killed or reaped here.
        self.foreign = {child.pid for child in psutil.Process().children(recursive=True)}
        self.shm_names: set[str] = set()
        self.netns_baseline = _netns()
        self.env = {**os.environ, "SNAPCTL_STATE_DIR": str(self.state), API_KEY_ENV: API_KEY}
        self.env.pop("CI", None)

    # -- running snapctl ------------------------------------------------------------------

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            _cli(*args), env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip

    def run(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "snapctl", *args], env=self.env, capture_output=True,
            text=True, timeout=timeout_s, check=False,
        )  # fmt: skip

    def must(self, *args: str) -> str:
        done = self.run(*args)
        if done.returncode != 0:
            raise RuntimeError(f"snapctl {' '.join(args)}: {done.returncode}: {done.stderr}")
        return done.stdout

    def argv(self, command: Command, image: Path, detach: bool) -> list[str]:
        fill = {"image": str(image), "base": str(self.base), "archive": str(self.archive)}
        argv = [part.format(**fill) for part in command.argv]
        return [*argv, "--detach", "--json"] if detach else argv

    # -- setup: the base image, its archive, and each command's window ---------------------

    def setup(self) -> None:
        self.images.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        self.must("bake", "--image", str(self.base), *KEY)
        self.windows["bake"] = time.monotonic() - started
        self.must("image", "export", str(self.base), "--out", str(self.archive))
        for command in COMMANDS:
            if command.name == "bake":
                continue
            label = f"calibrate-{command.name.replace(' ', '-')}"
            argv = self.argv(command, self.images / label, detach=command.detachable)
            if command.detachable:
                argv += ["--name", label]
            started = time.monotonic()
            process = self.spawn(*argv)
            reserved = self.wait_reserved(label, process, 180) if command.detachable else None
            out, err = process.communicate(timeout=180)
            if process.returncode != 0:
                raise RuntimeError(f"snapctl {' '.join(argv)}: {process.returncode}: {err!r}")
            self.windows[command.name] = time.monotonic() - started
            if reserved is not None:
                self.start_spans[command.name] = time.monotonic() - reserved
                self.must("stop", json.loads(out)["name"])
        self.reap()

    def wait_reserved(self, name: str, process: subprocess.Popen[bytes], limit_s: float) -> float:
        """When ``name`` was reserved (its lock file names its holder: a pre-check's lock,
        taken and let go at once, names none), or when the command exited or ``limit_s``
        passed without that."""
        deadline = time.monotonic() + limit_s
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if read_holder(self.state / "records", name) is not None:
                    break
            time.sleep(0.005)
        return time.monotonic()

    # -- one kill ---------------------------------------------------------------------------

    def kill_once(self, index: int) -> Kill:
        command = self.rng.choice(COMMANDS)
        modes = KILL_MODES if command.detachable else KILL_MODES[:2]
        mode = self.rng.choice(modes)
        detach = mode == "process+supervisor" or (command.detachable and self.rng.random() < 0.3)
        # A little past the calibrated time: a kill just after "ready" is a window too.
        delay = self.rng.uniform(0.0, self.windows[command.name] * 1.15)
        image = self.images / f"kill-{index}"
        argv = self.argv(command, image, detach)
        process = self.spawn(*argv)
        exited = _sleep_unless_exited(process, delay)
        window = self.window(command, image, process)
        if mode == "group":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        # Looked for once the command is killed (a killed process forks no more): looked for
        # before, a supervisor forked between the look and the kill was missed.
        supervisors = _supervisors(process.pid, _cli(*argv))
        if mode == "process+supervisor":
            for supervisor in supervisors:
                with contextlib.suppress(psutil.NoSuchProcess):
                    supervisor.kill()
        process.communicate(timeout=60)
        # A supervisor not killed goes on (its command returned or died, not it): it finishes
        # its start, serves or fails, and gc must leave it alone; then it is stopped by name.
        survivors = [] if mode == "process+supervisor" else _supervisors(process.pid, _cli(*argv))
        supervised = self.wait_supervised(survivors)
        before = self.leftovers()
        gc = self.run("gc", "--json")
        spared = self.still_supervised(supervised)
        for name in spared:
            self.run("stop", name)
        after = self.leftovers(settle_s=5.0)
        kill = Kill(
            index=index, command=command.name, mode=mode, detach=detach, delay_s=round(delay, 3),
            window=window, exited_before_kill=exited,
            hit=not exited or (mode == "process+supervisor" and bool(supervisors)),
            before_gc=_counts(before),
            after_gc=_counts(after), gc_status=gc.returncode, supervised_survivors=len(supervised),
            gc_killed_supervised=len(supervised) - len(spared),
            after_gc_detail=[f"{kind}: {item}" for kind, items in after.items() for item in items],
        )  # fmt: skip
        kill.corrupt_images = self.corrupt_images()
        if (index + 1) % self.next_copy_every == 0:
            kill.next_copy = self.next_copy()
        self.reap()
        self.clear(after)
        return kill

    def stop_once(self, index: int) -> Kill:
        """Kill a named detached start's command (alone: its supervisor goes on) at a random
        instant between its name's reservation and a little past its calibrated report
        (before the reservation nothing has started: the kill rounds cover that), stop the
        activation by name right after, then run one gc. The stop runs in a CLI process that
        started beforehand, so that it comes right after the kill, not a Python start later
        (the fixture's starts are short)."""
        command = self.rng.choice([c for c in COMMANDS if c.detachable])
        name = f"stop-{index}"
        image = self.images / f"kill-{index}"
        argv = [*self.argv(command, image, detach=True), "--name", name]
        stop_cli = WarmCli(self.env)
        started = time.monotonic()
        process = self.spawn(*argv)
        self.wait_reserved(name, process, self.windows[command.name] * 4)
        span = self.start_spans[command.name] * 1.15
        exited = _sleep_unless_exited(process, self.rng.uniform(0.0, span))
        delay = time.monotonic() - started
        window = self.window(command, image, process)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        stopped = stop_cli.run("stop", name, "--json")
        process.communicate(timeout=60)
        if stopped.returncode == 0:
            stop = str(json.loads(stopped.stdout)["stopped"])
        elif f"no activation named {name!r}" in stopped.stderr:
            stop = "no activation"
        else:
            stop = f"failed ({stopped.returncode}): {stopped.stderr.strip()[-300:]}"
        before = self.leftovers()
        gc = self.run("gc", "--json")
        after = self.leftovers(settle_s=5.0)
        kill = Kill(
            index=index, command=command.name, mode=STOP_MODE, detach=True,
            delay_s=round(delay, 3), window=window, exited_before_kill=exited, hit=not exited,
            before_gc=_counts(before), after_gc=_counts(after), gc_status=gc.returncode,
            after_gc_detail=[f"{kind}: {item}" for kind, items in after.items() for item in items],
            stop=stop,
        )  # fmt: skip
        kill.corrupt_images = self.corrupt_images()
        self.reap()
        self.clear(after)
        return kill

    def wait_supervised(self, supervisors: list[psutil.Process]) -> list[str]:
        """Wait until each surviving supervisor serves (has a record) or has given up; return
        the names it serves."""
        deadline = time.monotonic() + 120
        pids = {s.pid for s in supervisors}
        while pids and time.monotonic() < deadline:
            serving = {r["supervisor_pid"] for r in self.records()}
            running = {pid for pid in pids if _running(pid)}
            if running <= serving:
                break
            time.sleep(0.1)
        return [r["name"] for r in self.records() if r["supervisor_pid"] in pids]

    def still_supervised(self, names: list[str]) -> list[str]:
        rows = {row["name"]: row for row in json.loads(self.must("ps", "--json"))}
        return [n for n in names if n in rows and rows[n]["running"] and rows[n]["supervised"]]

    def records(self) -> list[dict[str, Any]]:
        found = []
        for path in (self.state / "records").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                found.append(json.loads(path.read_text()))
        return found

    def window(self, command: Command, image: Path, process: subprocess.Popen[bytes]) -> str:
        """Where the command was when it was killed, from what it had made so far."""
        if process.poll() is not None:
            return "after exit"
        staging = any(self.images.glob(f".{image.name}.staging-*"))
        activations = _entries(self.state / "activations")
        records = [p for p in _entries(self.state / "records") if p.endswith(".json")]
        if command.name == "image import":
            return "unpacking" if staging else ("published" if image.exists() else "starting")
        if command.new_image and staging:
            return "capturing"
        if len(records) > 0:
            return "serving"
        if command.new_image and image.exists():
            return "after publish"
        return "restoring/activating" if activations else "starting"

    # -- what is left -----------------------------------------------------------------------

    def leftovers(self, settle_s: float = 0.0) -> dict[str, list[str]]:
        deadline = time.monotonic() + settle_s
        while True:
            found = self._leftovers()
            if not found["processes"] or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def _leftovers(self) -> dict[str, list[str]]:
        processes = []
        for child in psutil.Process().children(recursive=True):
            if child.pid in self.foreign:
                continue
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.status() != psutil.STATUS_ZOMBIE:
                    processes.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
        records = self.state / "records"
        staging = [p for pattern in LEFTOVER_GLOBS for p in self.images.glob(pattern)]
        tmp_records = list(records.glob("*.tmp")) if records.is_dir() else []
        return {
            "processes": processes,
            "mounts": mounts.mounts_under(self.root),
            "shm": self.host_shm_leaks(),
            "netns": sorted(_netns() - self.netns_baseline),
            "staging": sorted(map(str, staging)),
            "tmp_records": sorted(map(str, tmp_records)),
            "activations": _entries(self.state / "activations"),
            "records": [p for p in _entries(records) if p.endswith(".json")],
            "reservations": [p for p in _entries(records) if p.endswith(".lock")],
        }

    def host_shm_leaks(self) -> list[str]:
        """Names an activation of this round used in its private /dev/shm (or an image saved)
        that exist in the host's: other processes on this host use /dev/shm too."""
        for shm in self.state.glob("activations/*/shm"):
            with contextlib.suppress(OSError):
                self.shm_names.update(os.listdir(shm))
        for manifest in self.images.glob("*/manifest.json"):
            with contextlib.suppress(OSError, ValueError):
                self.shm_names.update(json.loads(manifest.read_text()).get("shm_files", []))
        return sorted((set(os.listdir("/dev/shm")) - self.shm_baseline) & self.shm_names)

    def corrupt_images(self) -> list[str]:
        """Image directories that exist but do not verify (half-published or damaged)."""
        bad = []
        for image in sorted(self.images.iterdir()):
            if image.name.startswith("."):
                continue  # staging: counted as a leftover, never as an image
            try:
                verify_image(image)
            except Exception as error:  # any failure at all is a corrupt image
                bad.append(f"{image.name}: {error}")
        return bad

    def next_copy(self) -> str:
        """A fresh copy from the base image must serve after the kill and gc."""
        done = self.run("copy", "--image", str(self.base), "--no-lazy", *KEY, *PUBLISH,
                        "--detach", "--json")  # fmt: skip
        if done.returncode != 0:
            return f"copy failed ({done.returncode}): {done.stderr.strip()[-300:]}"
        record = json.loads(done.stdout)
        try:
            request = urllib.request.Request(f"http://{record['published']}/v1/models")
            request.add_header("Authorization", f"Bearer {API_KEY}")
            with urllib.request.urlopen(request, timeout=30) as response:
                status = response.status
        except OSError as error:
            status = f"{error}"
        stopped = self.run("stop", record["name"])
        if status != 200:
            return f"copy did not serve: {status}"
        return "ok" if stopped.returncode == 0 else f"stop failed: {stopped.stderr.strip()}"

    def reap(self) -> None:
        """Reap the zombies reparented here (only now: until gc ran they stood for dead)."""
        for child in psutil.Process().children():
            if child.pid in self.foreign:
                continue
            with contextlib.suppress(psutil.NoSuchProcess, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, 0)

    def clear(self, left: dict[str, list[str]]) -> None:
        """After counting, start the next kill from a clean slate whatever was left."""
        for line in left["processes"]:
            with contextlib.suppress(psutil.NoSuchProcess, ValueError):
                psutil.Process(int(line.split()[0])).kill()  # our descendant (subreaper)
        if any(left.values()):
            self.run("gc")
            for point in reversed(mounts.mounts_under(self.root)):
                with contextlib.suppress(OSError):
                    mounts.umount(Path(point))
        for image in self.images.iterdir():
            if image.name.startswith("kill-") or image.name.startswith("."):
                subprocess.run(["rm", "-rf", "--one-file-system", str(image)], check=False)
        self.reap()

    # -- the whole round --------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        windows: Counter[str] = Counter(f"{k.command} / {k.window}" for k in self.kills)
        before = Counter[str]()
        after = Counter[str]()
        for kill in self.kills:
            before.update(kill.before_gc)
            after.update(kill.after_gc)
        tried = [k for k in self.kills if k.next_copy is not None]
        stops = Counter(k.stop for k in self.kills if k.stop is not None)
        dirty_before = [k for k in self.kills if any(k.before_gc.values())]
        dirty_after = [k for k in self.kills if any(k.after_gc.values())]
        return {
            "kills": len(self.kills),
            "kills_that_hit": sum(1 for k in self.kills if k.hit),
            "kills_per_command": dict(Counter(k.command for k in self.kills)),
            "kills_per_mode": dict(Counter(k.mode for k in self.kills)),
            "kills_per_command_and_window": dict(sorted(windows.items())),
            "kills_with_leftovers_before_gc": len(dirty_before),
            "leftovers_before_gc": dict(before),
            "kills_with_leftovers_after_gc": len(dirty_after),
            "leftovers_after_gc": dict(after),
            "gc_failures": sum(1 for k in self.kills if k.gc_status != 0),
            "supervised_survivors": sum(k.supervised_survivors for k in self.kills),
            "gc_killed_supervised": sum(k.gc_killed_supervised for k in self.kills),
            "corrupt_images": sum(len(k.corrupt_images) for k in self.kills),
            "stops": dict(stops),
            "stop_failures": sum(n for stop, n in stops.items() if stop.startswith("failed")),
            "next_copies": len(tried),
            "next_copy_failures": sum(1 for k in tried if k.next_copy != "ok"),
            "calibrated_windows_s": {k: round(v, 2) for k, v in self.windows.items()},
            "calibrated_start_spans_s": {k: round(v, 2) for k, v in self.start_spans.items()},
        }

    def run_round(self, kills: int, *, stops: int = 0, final_copy: bool = True) -> dict[str, Any]:
        _become_subreaper(True)
        try:
            self.setup()
            for index in range(kills):
                self.kills.append(self.kill_once(index))
            for index in range(kills, kills + stops):
                self.kills.append(self.stop_once(index))
            if final_copy:
                self.kills[-1].next_copy = self.kills[-1].next_copy or self.next_copy()
        finally:
            self.reap()
            _become_subreaper(False)
        return {"summary": self.summary(), "kills": [asdict(k) for k in self.kills]}


class WarmCli:
    """A snapctl CLI process that has done its imports and waits for its argv on stdin, then
    runs it as ``snapctl`` does (:func:`snapctl.entry.main`)."""

    CODE = (
        "import json, sys\n"
        "from snapctl.entry import main\n"
        "import snapctl.cli, snapctl.activation.supervise, snapctl.gc\n"
        "raise SystemExit(main(json.loads(sys.stdin.readline())))\n"
    )

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.CODE], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip

    def run(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        out, err = self.process.communicate(json.dumps(args) + "\n", timeout=timeout_s)
        return subprocess.CompletedProcess(list(args), self.process.returncode, out, err)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "snapctl", *args]


def _sleep_unless_exited(process: subprocess.Popen[bytes], delay_s: float) -> bool:
    try:
        process.wait(timeout=delay_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def _supervisors(pid: int, cmdline: list[str]) -> list[psutil.Process]:
    """The detached supervisor the command forked: a process with the same command line, its
    child or (once the command returned) reparented to us. The command's children are read
    before ours: a supervisor reparented between the two reads (the command returning just
    then) is in the second; read the other way round, it was in neither and was not killed."""
    candidates = []
    with contextlib.suppress(psutil.NoSuchProcess):
        candidates += psutil.Process(pid).children()
    candidates += psutil.Process().children()
    found = {}
    for candidate in candidates:
        with contextlib.suppress(psutil.NoSuchProcess):
            if candidate.pid != pid and candidate.cmdline() == cmdline:
                found[candidate.pid] = candidate
    return list(found.values())


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def _netns() -> set[str]:
    return set(_entries(Path("/run/netns")))


def _counts(found: dict[str, list[str]]) -> dict[str, int]:
    return {kind: len(items) for kind, items in found.items() if items}


def _become_subreaper(on: bool) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--stops", type=int, default=0,
                        help="stop rounds after the kills: a detached start's command killed, "
                             "then stop NAME")  # fmt: skip
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--next-copy-every", type=int, default=4)
    parser.add_argument("--out", type=Path, help="write every kill and the summary here (JSON)")
    parser.add_argument("--root", type=Path, help="work directory (default: a fresh temp dir)")
    args = parser.parse_args(argv)
    root = args.root or Path(tempfile.mkdtemp(prefix="snapctl-chaos-"))
    driver = Driver(root, args.seed, next_copy_every=args.next_copy_every)
    started = time.monotonic()
    result = driver.run_round(args.kills, stops=args.stops)
    result["summary"]["seconds"] = round(time.monotonic() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    summary = result["summary"]
    clean = not summary["kills_with_leftovers_after_gc"] and not summary["stop_failures"]
    ok = clean and not summary["corrupt_images"]
    return 0 if ok and not summary["next_copy_failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
