"""Images through an OCI registry, measured on loopback (``python -m bench.registry``, root).

Prints, for the fixture with ``--retained-mb`` of retained memory:

- push and pull throughput against ``image export`` and ``import`` of the same image (each
  push to a fresh repository, each pull into an empty cache);
- the bytes a second push uploads after a re-bake of the same server to the same repository,
  against the first push;
- the time from ``copy --image REF`` on an empty cache to the first correct completion,
  against a pull and a copy from the pulled directory done one after the other.

The registry is Debian's ``docker-registry``, started on loopback in the scratch directory
(the tests' helper) and stopped by PID after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.workload import Answer, ensure_model, first_correct, host_connect, launch_options
from snapctl.activation.copy import start_copy
from snapctl.activation.donor import start_donor
from snapctl.activation.native import NoNativeStep
from snapctl.activation.precheck import decide_lazy
from snapctl.criu import find_criu
from snapctl.images import load_manifest
from snapctl.images.archive import export_image, import_image
from snapctl.registry.cache import BlobCache
from snapctl.registry.client import Reference, RegistryClient
from snapctl.registry.pull import pull_image
from snapctl.registry.push import PushReport, push_image
from snapctl.registry.source import pull_for_copy
from snapctl.statedir import StateDir
from tests.registry.server import start_registry


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _client(address: str, name: str) -> RegistryClient:
    return RegistryClient(Reference.parse(f"{address}/{name}"), plain_http=True)


def _timed(run: Callable[[], Any]) -> float:
    started = time.monotonic()
    run()
    return time.monotonic() - started


class Bench:
    def __init__(self, work: Path, retained_mb: int) -> None:
        self.work = work
        self.retained_mb = retained_mb
        self.state = StateDir(work / "state")
        self.criu = find_criu()
        self.figures: dict[str, Any] = {"retained_mb": retained_mb}

    def capture(self, path: Path) -> None:
        session, _ = start_donor(
            launch_options(self.retained_mb), image=path, force=True, criu=self.criu,
            native=NoNativeStep(), publish=None, state=self.state, progress=lambda _: None,
            activate_donor=False,
        )  # fmt: skip
        session.stop()

    def copy_until_correct(self, image: Path, reference: Answer | None) -> Answer:
        lazy = decide_lazy(None, image)
        session, report = start_copy(
            image, launch_options(self.retained_mb), criu=self.criu, native=NoNativeStep(),
            publish=("127.0.0.1", 0), state=self.state, progress=lambda _: None, lazy=lazy,
        )  # fmt: skip
        try:
            assert report.published is not None
            port = int(report.published.rsplit(":", 1)[1])
            return first_correct(host_connect(port), reference, 300)
        finally:
            if session.lazy is not None:
                session.lazy.wait(300)
            session.stop()


def run(retained_mb: int, reps: int, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="snapctl-bench-registry-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        bench = Bench(work, retained_mb)
        ensure_model(bench.state)
        registry = start_registry(work / "registry")
        try:
            return _measure(bench, registry.address, reps, say)
        finally:
            registry.stop()


def _measure(bench: Bench, address: str, reps: int, say: Callable[[str], None]) -> dict[str, Any]:
    work, figures = bench.work, bench.figures
    first, second = work / "bake-1", work / "bake-2"
    say(f"baking the fixture with {bench.retained_mb} MiB retained, twice")
    bench.capture(first)
    bench.capture(second)
    image_bytes = load_manifest(first).total_bytes
    figures["image_mb"] = round(image_bytes / 1e6, 1)

    export_s, import_s, push_s, pull_s = [], [], [], []
    for rep in range(reps):
        say(f"export/import and push/pull, repetition {rep + 1} of {reps}")
        archive, imported = work / "image.tar.zst", work / "imported"
        export_s.append(export_image(first, archive, force=True).seconds)
        import_s.append(import_image(archive, imported, force=True).seconds)
        archive.unlink()
        shutil.rmtree(imported)
        name = f"bench/throughput-{rep}:v1"
        push_s.append(push_image(first, Reference.parse(f"{address}/{name}"),
                                 _client(address, name)).seconds)  # fmt: skip
        cache = BlobCache(work / f"cache-{rep}")
        pull_s.append(pull_image(_client(address, name), work / "pulled", cache=cache,
                                 verified_cache=None, force=True).seconds)  # fmt: skip
        shutil.rmtree(cache.root)
    mb = image_bytes / 1e6
    for label, values in (("export", export_s), ("import", import_s), ("push", push_s),
                          ("pull", pull_s)):  # fmt: skip
        figures[f"{label}_s"] = round(_median(values), 3)
        figures[f"{label}_mb_per_s"] = round(mb / _median(values), 1)

    say("a re-bake pushed to the same repository")
    pushes: list[PushReport] = []
    for image, tag in ((first, "1"), (second, "2")):
        name = f"bench/rebake:{tag}"
        pushes.append(push_image(image, Reference.parse(f"{address}/{name}"),
                                 _client(address, name)))  # fmt: skip
    figures["first_push_mb"] = round(pushes[0].bytes_uploaded / 1e6, 1)
    figures["rebake_push_mb"] = round(pushes[1].bytes_uploaded / 1e6, 1)
    figures["rebake_push_fraction"] = round(pushes[1].bytes_uploaded / pushes[0].bytes_uploaded, 3)

    say("copy --image REF on an empty cache, against pull then copy")
    reference = bench.copy_until_correct(first, None)
    ref = f"{address}/bench/throughput-0:v1"
    together, apart_pull, apart_copy = [], [], []
    target = work / "pulled-apart"
    for _ in range(reps):
        shutil.rmtree(work / "state" / "cache", ignore_errors=True)
        started = time.monotonic()
        pulled = pull_for_copy(ref, bench.state, plain_http=True)
        bench.copy_until_correct(Path(pulled.image), reference)
        together.append(time.monotonic() - started)
        shutil.rmtree(work / "state" / "cache", ignore_errors=True)
        apart_pull.append(_timed(lambda: pull_image(
            _client(address, "bench/throughput-0:v1"), target, cache=BlobCache(work / "c"),
            verified_cache=bench.state.verified, force=True)))  # fmt: skip
        apart_copy.append(_timed(lambda: bench.copy_until_correct(target, reference)))
        shutil.rmtree(work / "c", ignore_errors=True)
    figures["copy_ref_empty_cache_s"] = round(_median(together), 3)
    figures["pull_then_copy_pull_s"] = round(_median(apart_pull), 3)
    figures["pull_then_copy_copy_s"] = round(_median(apart_copy), 3)
    figures["pull_then_copy_s"] = round(_median(apart_pull) + _median(apart_copy), 3)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.registry", description=__doc__)
    parser.add_argument("--retained-mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = run(args.retained_mb, args.reps, lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(figures))
        return 0
    f = figures
    print(f"image: {f['image_mb']} MB ({f['retained_mb']} MiB retained), medians of {args.reps}")
    print(f"export {f['export_s']} s ({f['export_mb_per_s']} MB/s), import {f['import_s']} s "
          f"({f['import_mb_per_s']} MB/s)")  # fmt: skip
    print(f"push   {f['push_s']} s ({f['push_mb_per_s']} MB/s), pull   {f['pull_s']} s "
          f"({f['pull_mb_per_s']} MB/s)")  # fmt: skip
    print(f"re-bake pushed to the same repository: {f['rebake_push_mb']} MB uploaded, first "
          f"push {f['first_push_mb']} MB ({f['rebake_push_fraction'] * 100:.1f}%)")  # fmt: skip
    print(f"copy --image REF, empty cache, to first correct: {f['copy_ref_empty_cache_s']} s; "
          f"pull {f['pull_then_copy_pull_s']} s + copy {f['pull_then_copy_copy_s']} s = "
          f"{f['pull_then_copy_s']} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
