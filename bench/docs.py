"""docs/benchmarks.md and its plot, generated from one run's :class:`Results` (never edited by
hand: ``python -m bench --write-docs`` rewrites both, ``--from-json`` re-renders a saved run)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.results import Figure, Results

PLOT_NAME = "benchmarks.png"
READY_CONTENDERS = ("cold start", "bare CRIU")

METHOD = """\
## Method

Everything is measured side by side in one run of `python -m bench` on one machine. Each
repetition runs every contender once, and the contenders' order rotates from one repetition to
the next, so load from the other work on this shared machine falls on all of them alike. Tables
give the median, the spread as [min-max], and the number of samples; targets compare medians
measured in the same run, as ratios, never against figures from another run.

The workload is the bundled fixture server (`python -m fixtures serve`, a 4 MiB model, 8 MiB
of KV cache) with `--retained-mb N` of initialized engine memory, the part of a server's state
that a restore brings back and a cold start must rebuild. For each size the benchmark captures
one image with snapctl (`start_donor`, not timed) and obtains the correct answer from one
untimed cold start. Every timed start ends with the *first correct completion*: a greedy
completion (8 tokens) whose text and token ids equal that reference; a wrong answer fails the
run. Before the timed repetitions each restore contender runs once untimed (page cache, snapctl's
verification cache, imports), which is the steady state of a host that serves copies.

Contenders:

- **cold start**: `python -m fixtures serve` without `--snapshot-config` on a free host port,
  timed from `Popen` to the first correct completion (interpreter start, imports, model load,
  filling the retained memory, warm-up, bind).
- **bare CRIU**: the least a capturer must do, without snapctl (`bench/bare.py`): create the
  copy's directories, mount a tmpfs and copy the saved `/dev/shm` into it (hard links kept),
  run `criu restore -d` with raw argv through the same binary (`find_criu`) and the same tree
  options and external mounts, at CRIU's default log level; then write `activation.json` and
  `release.json` directly (no fsync, no pydantic) and poll every 1 ms for `challenge.json` and
  `status.json` = validated; the completion is sent from a thread inside the copy's network
  namespace.
- **snapctl copy**: `start_copy` (what `snapctl copy` runs): image verification (cached by
  file identity after the first, full hash), the identity gate, fresh activation directories,
  shm staging, `criu restore` (info-level logs), pinning the restored tree, the v1 handshake
  through `ControlDir`, the HTTP probe, then a host port published through the copy's
  namespace; the completion goes through that published port.
- **snapctl copy --lazy**: the same with `lazy=True`: a view of the image in which only runs
  of 16 MiB or more stay lazy (`lazy view`), its own `criu lazy-pages` daemon started together
  with the `--lazy-pages` restore (held at its inventory until the daemon listens), serving
  while pages still arrive; with 1 GiB or more left lazy the daemon's background transfer is
  held until 50 ms after the HTTP probe answered (until then it serves faults only); each run
  waits until the daemon has pushed every page before the next contender starts (and reports
  when that was).

Restore-to-validated is measured from the contender's "go" to `status.json` = validated.
snapctl's phases come from `report.timings_s`, placed on one clock by its progress callbacks,
so work between the timed phases is counted too (`setup`, `after restore`).

Donor pause is CRIU's own `frozen_time` (from `stats-dump`) for `start_donor` and for a bare
`criu dump --leave-running` of a tree launched the same way (snapctl's sandbox, waited to
capture-ready), at CRIU's default log level and at its debug level (`-v4`); snapctl runs its
dumps, restores and lazy-pages daemons at info level (`-v3`).

Throughput is the size of the image's `criu/` directory divided by the wall time of the
`criu restore` process, next to reading the same files from page cache into one reused buffer,
and into freshly mapped memory (which every restored page needs). CLI start is the wall
time of the console script. Concurrency runs `start_copies` with 1, 2 and 4 copies of one image.
"Started together" (section 7) starts 1, 2 and 4 plain or lazy copies as `start_copies` does
(one verification, one `start_copy` per thread) at every size; each copy's thread sends its
first completion as soon as its own start returned, and waits for all of its pages.
"""


def _num(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "ms":
        return f"{value:.1f} ms"
    if unit == "MB/s":
        return f"{value:,.0f} MB/s"
    return f"{value:.2f}x"


def cell(figure: Figure | None) -> str:
    if figure is None:
        return "-"
    unit = figure.unit
    if len(figure.samples) == 1:
        return f"{_num(figure.median, unit)} (n=1)"
    low, high = _num(figure.low, unit), _num(figure.high, unit)
    return f"{_num(figure.median, unit)} [{low} - {high}] (n={len(figure.samples)})"


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def _contenders(results: Results, metric: str) -> list[str]:
    seen: list[str] = []
    for figure in results.figures:
        if figure.metric == metric and figure.contender not in seen:
            seen.append(figure.contender)
    return seen


def _sizes(results: Results, metric: str) -> list[int]:
    return sorted({f.size_mb for f in results.figures if f.metric == metric and f.size_mb})


def _by_size(results: Results, metric: str, contenders: list[str] | None = None) -> list[str]:
    contenders = contenders or _contenders(results, metric)
    rows = [
        [f"{size} MB", *(cell(results.find(metric, c, size)) for c in contenders)]
        for size in _sizes(results, metric)
    ]
    return _table(["retained", *contenders], rows)


def _ratio(results: Results, metric: str, top: str, bottom: str, size: int) -> str:
    a, b = results.find(metric, top, size), results.find(metric, bottom, size)
    return "-" if a is None or b is None else f"{a.median / b.median:.2f}x"


def _median(results: Results, metric: str, contender: str, size: int | None) -> float | None:
    figure = results.find(metric, contender, size)
    return None if figure is None else figure.median


def _difference(results: Results, snap: str) -> list[str]:
    """snapctl minus bare CRIU, phase by phase (medians), so the overhead has an address."""
    rows = []
    for size in _sizes(results, "validated_s"):
        own = sum(
            _median(results, f"phase:{p}", snap, size) or 0.0
            for p in ("verify", "identity", "setup", "after restore")
        )
        cells = [f"{size} MB", _num(own, "s")]
        for phase in ("stage", "criu", "handshake"):
            a = _median(results, f"phase:{phase}", snap, size)
            b = _median(results, f"phase:{phase}", "bare CRIU", size)
            cells.append("-" if a is None or b is None else f"{(a - b) * 1000:+.1f} ms")
        a, b = (_median(results, "validated_s", c, size) for c in (snap, "bare CRIU"))
        cells.append("-" if a is None or b is None else f"{(a - b) * 1000:+.1f} ms")
        rows.append(cells)
    return [
        "Where the difference goes (snapctl minus bare CRIU, medians; `verify`, `identity`, "
        "`setup` and `after restore` exist only in snapctl):",
        "",
        *_table(
            ["retained", "snapctl's own steps", "stage", "criu", "handshake", "total"],
            rows,
        ),
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _lazy_ready_note(results: Results, name: str, size: int) -> str:
    """Where a lazy copy's time to its first correct completion goes, with this run's medians."""

    def phase(p: str, who: str = LAZY) -> float | None:
        return _median(results, f"phase:{p}", who, size)

    checks = sum(phase(p) or 0.0 for p in ("verify", "identity", "setup", "stage"))
    after = sum(
        _median(results, f"after:{a}", LAZY, size) or 0.0
        for a in ("HTTP probe", "rest of start_copy", "first completion")
    )
    plain = _median(results, "ready_s", PLAIN, size)
    view, criu = _ms(phase("lazy view")), _ms(phase("criu"))
    daemon = _ms(_median(results, "lazy_pages_ready_s", LAZY, size))
    handshake, plain_handshake = _ms(phase("handshake")), _ms(phase("handshake", PLAIN))
    return (
        f"- *{name}*: the lazy copy's time is fixed costs that do not shrink with memory "
        f"(medians): snapctl's checks and staging {_ms(checks)}, the image view {view}, "
        f"`criu restore --lazy-pages` {criu} (its daemon starts alongside and listens after "
        f"{daemon}; both read CRIU's kernel probe from snapctl's per-boot cache), the handshake "
        f"{handshake} (plain: {plain_handshake}), then probe, report and completion "
        f"{_ms(after)} (the background transfer starts 50 ms after the probe). The restore "
        "brings about 50 MB of small memory in eagerly (interpreter heaps and arenas, which the "
        "recovery touches at once; faulting them in one by one costs more, see docs/lazy.md), "
        "and on this VM memory freed shortly before is handed back to the host and is slow to "
        f"fill again. A plain copy's time grows with memory ({_ms(plain)} here), which is all "
        "the ratio can gain from."
    )


def _lazy_pages_note(results: Results, name: str, size: int) -> str:
    lazy = results.find("pages_present_s", LAZY, size)
    plain = results.find("pages_present_s", PLAIN, size)
    note = (
        f"- *{name}*: lazy {cell(lazy)} against plain {cell(plain)}. A lazy copy's background "
        "transfer shares the 2 cores with the copy's own recovery and first requests, where a "
        "plain restore copies every page in one pass before the server runs."
    )
    alone_lazy = results.find("at_once_pages_present_s", f"{LAZY}, 1 at once", size)
    alone_plain = results.find("at_once_pages_present_s", f"{PLAIN}, 1 at once", size)
    if alone_lazy is not None and alone_plain is not None:
        note += (
            f" Started alone in section 7 (no cold start in those repetitions): lazy "
            f"{cell(alone_lazy)}, plain {cell(alone_plain)}. On this VM memory freed by a "
            "process (a cold start's retained memory, a stopped copy's) goes back to the host "
            "within seconds and is slow to fill again, and the longest fill, here the lazy "
            "transfer, is the most exposed: compare the spreads."
        )
    return note


def _misses(results: Results, snap: str) -> list[str]:
    """Why a missed target was missed, with this run's own figures."""
    notes = []
    for target in results.targets:
        if target.met:
            continue
        size = int(target.name.rsplit(", ", 1)[1].split()[0]) if ", " in target.name else None
        if target.name.startswith("restore throughput") and size is not None:
            restore = _median(results, "restore_MBps", snap, size)
            bare = _median(results, "restore_MBps", "bare CRIU", size)
            cached = _median(results, "read_MBps", "page cache -> reused buffer", size)
            fresh = _median(results, "read_MBps", "page cache -> fresh memory", size)
            if not (restore and bare and cached and fresh):
                continue
            notes.append(
                f"- *{target.name}*: a restore puts every page into memory the copy never "
                f"touched. On this VM newly mapped memory is slow to fill: reading the same "
                f"files into fresh memory runs at {fresh:,.0f} MB/s, {fresh / cached:.0%} of the "
                f"page-cache rate, and snapctl's restore runs at {restore / fresh:.1f}x that "
                f"({restore:,.0f} MB/s; bare CRIU {bare:,.0f} MB/s). Half the page-cache rate "
                "would need memory that is already backed; snapctl adds nothing to this phase "
                "but its log level (see section 2), and fixed costs (forking, namespaces, "
                "mounts) weigh most at small sizes."
            )
        elif target.name.startswith("donor frozen") and size is not None:
            ours = results.find("frozen_s", "snapctl donor", size)
            theirs = results.find("frozen_s", "bare CRIU dump", size)
            verbose = results.find("frozen_s", "bare CRIU dump -v4", size)
            if ours is None or theirs is None:
                continue
            overlap = ours.low <= theirs.high and theirs.low <= ours.high
            note = f"- *{target.name}*: snapctl {cell(ours)} against bare CRIU {cell(theirs)}"
            if verbose is not None:
                note += f" and bare CRIU at debug level (`-v4`) {cell(verbose)}"
            note += (
                "; the spreads overlap, so this run cannot tell them apart on this shared machine. "
                if overlap
                else ". "
            )
            note += (
                "snapctl's dump differs from the bare one only by its log level (`-v3`) and its "
                "post-dump action script (`cp -a` of the activation's /dev/shm while the tree is "
                "frozen)."
            )
            notes.append(note)
        elif target.name.startswith("handshake"):
            recovery = [
                v for f in results.figures if f.metric == "server_recovery_ms" for v in f.samples
            ]
            minimal = [
                v
                for f in results.figures
                if f.metric == "handshake_ms" and f.contender == "bare CRIU"
                for v in f.samples
            ]
            if recovery and minimal:
                notes.append(
                    f"- *{target.name}*: the handshake contains the server's own recovery "
                    f"(median {statistics.median(recovery):.1f} ms from `recovering` to "
                    f"`validated`: remapping and hashing the weights, refilling the KV cache in "
                    f"fresh memory, the canary), which no capturer can shorten; bare CRIU's "
                    f"minimal handshake takes {statistics.median(minimal):.1f} ms (median) too. "
                    f"The other {statistics.median(minimal) - statistics.median(recovery):.0f} ms "
                    "are the protocol itself, mostly on the server's side: it polls for "
                    "activation.json and release.json every 5 ms (`snapctl.launcher`, which must "
                    "not hold an inotify descriptor or thread in the image) and writes three "
                    "files with fsync."
                )
        elif target.name.startswith("lazy copy:") and size is not None:
            notes.append(_lazy_ready_note(results, target.name, size))
        elif target.name.startswith("plain / lazy copy:") and size is not None:
            plain = _median(results, "ready_s", PLAIN, size)
            lazy = _median(results, "ready_s", LAZY, size)
            notes.append(
                f"- *{target.name}*: the plain copy answers after {_ms(plain)}, the lazy one "
                f"after {_ms(lazy)}; 8x would need the lazy copy under "
                f"{_ms(None if plain is None else plain / 8)}, below its fixed costs (see the "
                "note on the lazy copy's first correct completion)."
            )
        elif target.name.startswith("lazy / plain copy:") and size is not None:
            notes.append(_lazy_pages_note(results, target.name, size))
        else:
            notes.append(
                f"- *{target.name}*: see the phase tables below; on this shared machine compare "
                "the spread of both contenders before reading much into a small difference."
            )
    if not notes:
        return []
    return ["Why targets were missed:", "", *notes, ""]


PLAIN, LAZY = "snapctl copy", "snapctl copy --lazy"


def _lazy_against_plain(results: Results) -> list[str]:
    """Lazy against plain, size by size: first correct completion and all pages present."""
    sizes = [s for s in _sizes(results, "pages_present_s") if results.find("ready_s", LAZY, s)]
    if not sizes:
        return []
    rows = []
    for size in sizes:
        rows.append(
            [f"{size} MB",
             cell(results.find("ready_s", PLAIN, size)), cell(results.find("ready_s", LAZY, size)),
             _ratio(results, "ready_s", PLAIN, LAZY, size),
             cell(results.find("pages_present_s", PLAIN, size)),
             cell(results.find("pages_present_s", LAZY, size)),
             _ratio(results, "pages_present_s", LAZY, PLAIN, size)]
        )  # fmt: skip
    header = [
        "retained", "plain: first correct", "lazy: first correct", "plain / lazy",
        "plain: all pages", "lazy: all pages", "lazy / plain",
    ]  # fmt: skip
    return [
        "Lazy against plain: first correct completion, and every page of the copy "
        "in place (plain: `criu restore` returned; lazy: its daemon exited 0), both from the "
        "start of `start_copy`:",
        "",
        *_table(header, rows),
    ]


def _at_once(results: Results) -> list[str]:
    sizes = _sizes(results, "at_once_ready_s")
    if not sizes:
        return []
    labels = _contenders(results, "at_once_ready_s")
    out = [
        "### Plain and lazy copies started together",
        "",
        f"{results.settings.at_once_reps} repetitions per size and count; per copy, from the "
        "common start: its first correct completion (sent as soon as its own `start_copy` "
        "returned) and every page of it in place.",
        "",
    ]
    for size in sizes:
        out += [f"**{size} MB**", ""]
        out += _table(
            ["copies", "first correct (per copy)", "all pages present (per copy)"],
            (
                [label, cell(results.find("at_once_ready_s", label, size)),
                 cell(results.find("at_once_pages_present_s", label, size))]
                for label in labels
                if results.find("at_once_ready_s", label, size) is not None
            ),
        )  # fmt: skip
    return out


def render(results: Results, plot: str | None) -> str:
    m, s = results.machine, results.settings
    snap = next((c for c in s.contenders if c.startswith("snapctl")), "snapctl copy")
    out = [
        "# Benchmarks: how fast a copy serves",
        "",
        "Generated by `python -m bench --write-docs` (figures, tables and plot; do not edit by "
        "hand). Raw samples: [benchmarks.json](benchmarks.json). Re-render without measuring: "
        "`python -m bench --from-json docs/benchmarks.json --write-docs`.",
        "",
    ]
    if s.quick:
        out += ["**Quick run** (`--quick`): small sizes, few repetitions; indicative only.", ""]
    out += ["## Targets", ""]
    out += _table(
        ["target", "measured", "goal", "met"],
        (
            [t.name, _num(t.measured, t.unit), f"{t.comparison} {_num(t.limit, t.unit)}",
             "yes" if t.met else "**no**"]
            for t in results.targets
        ),
    )  # fmt: skip
    out += _misses(results, snap)
    if results.failures:
        out += ["Timed starts that failed and were retried once:", ""]
        out += [f"- {failure}" for failure in results.failures] + [""]
    out += [METHOD, "## Machine", ""]
    out += _table(
        ["", ""],
        [
            ["CPU", f"{m.cpu}, {m.cores} cores"],
            ["memory", f"{m.memory_gib} GiB"],
            ["kernel", m.kernel],
            ["Python", m.python],
            ["CRIU", m.criu],
            ["load average at start", ", ".join(f"{x:.2f}" for x in m.load_average)],
            ["date", m.date],
            [
                "run",
                f"{results.wall_s:.0f} s; {s.reps} reps per size, donor {s.donor_reps}, "
                f"CLI {s.cli_reps}",
            ],
        ],
    )
    out += ["## 1. Time to first correct completion", ""]
    if plot:
        out += [f"![time to first correct completion vs retained memory]({plot})", ""]
    out += _by_size(results, "ready_s")
    speedups = [
        [f"{size} MB", _ratio(results, "ready_s", "cold start", snap, size)]
        for size in _sizes(results, "ready_s")
    ]
    out += ["Cold start / snapctl copy (how many times sooner a copy answers):", ""]
    out += _table(["retained", "speed-up"], speedups)
    if _sizes(results, "pages_complete_s"):
        out += [
            "A lazy copy serves before its memory is in; its lazy-pages daemon has pushed the "
            "last page this long after the start (the copy is complete only then):",
            "",
        ]
        out += _by_size(results, "pages_complete_s")
    out += _lazy_against_plain(results)
    out += [
        "From validated to the first correct completion (snapctl: its HTTP probe through the "
        "copy's namespace, the rest of `start_copy` (record, statistics, report), then the "
        "completion through the published port; bare CRIU: the completion from inside the "
        "namespace):",
        "",
    ]
    for contender in _contenders(results, "ready_s"):
        afters = list(
            dict.fromkeys(
                f.metric.split(":", 1)[1]
                for f in results.figures
                if f.metric.startswith("after:") and f.contender == contender
            )
        )
        if afters:
            out += [f"**{contender}**", ""]
            out += _table(
                ["retained", *afters],
                (
                    [
                        f"{size} MB",
                        *(cell(results.find(f"after:{a}", contender, size)) for a in afters),
                    ]
                    for size in _sizes(results, "ready_s")
                ),
            )

    out += ["## 2. snapctl overhead: restore to validated", ""]
    out += _by_size(results, "validated_s")
    out += _table(
        ["retained", f"{snap} / bare CRIU"],
        (
            [f"{size} MB", _ratio(results, "validated_s", snap, "bare CRIU", size)]
            for size in _sizes(results, "validated_s")
        ),
    )
    out += _difference(results, snap)
    out += ["Where the time goes (medians of each phase):", ""]
    for contender in dict.fromkeys((snap, LAZY, "bare CRIU")):
        phases = [
            f.metric.split(":", 1)[1]
            for f in results.figures
            if f.metric.startswith("phase:") and f.contender == contender
        ]
        phases = list(dict.fromkeys(phases))
        if not phases:
            continue
        out += [f"**{contender}**", ""]
        out += _table(
            ["retained", *phases, "CRIU's own restore_time"],
            (
                [f"{size} MB",
                 *(cell(results.find(f"phase:{p}", contender, size)) for p in phases),
                 cell(results.find("criu_restore_time_s", contender, size))]
                for size in _sizes(results, "validated_s")
            ),
        )  # fmt: skip
    out += ["## 3. Donor pause (CRIU frozen time)", ""]
    out += _by_size(results, "frozen_s")
    out += ["Whole dump (wall time of the `criu dump` process):", ""]
    out += _by_size(results, "dump_s")
    out += ["## 4. Image throughput", ""]
    out += _by_size(results, "restore_MBps")
    out += ["The same image files read from page cache:", ""]
    out += _by_size(results, "read_MBps")
    out += ["## 5. Handshake latency (activation written -> validated)", ""]
    out += _by_size(results, "handshake_ms")
    if _sizes(results, "server_recovery_ms"):
        out += [
            "Of which the server's own recovery (status.json `recovering` first seen -> "
            "`validated` seen; the fixture maps its weights again, checks every tensor's sha256, "
            "refills its KV cache and runs the canary), seen by the bare baseline's 1 ms polls:",
            "",
        ]
        out += _by_size(results, "server_recovery_ms")
    out += ["## 6. CLI start", ""]
    out += _table(
        ["command", "wall time"],
        ([c, cell(results.find("cli_start_s", c))] for c in _contenders(results, "cli_start_s")),
    )
    out += ["## 7. Concurrent copies from one image", ""]
    rows = []
    for contender in _contenders(results, "concurrent_total_s"):
        size = s.concurrency_mb
        rows.append(
            [contender, cell(results.find("concurrent_total_s", contender, size)),
             cell(results.find("concurrent_per_copy_s", contender, size))]
        )  # fmt: skip
    out += [f"{s.concurrency_mb} MB retained; per copy: the sum of its `timings_s`.", ""]
    out += _table(["copies", "all ready", "per copy"], rows)
    out += _at_once(results)
    return "\n".join(out).rstrip() + "\n"


def plot(results: Results, path: Path) -> bool:
    """Time to ready vs retained memory per contender; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from matplotlib.ticker import FuncFormatter

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    sizes = _sizes(results, "ready_s")
    colors: dict[str, Any] = {}  # matplotlib colour specs
    for contender in _contenders(results, "ready_s"):
        figs = [results.find("ready_s", contender, size) for size in sizes]
        points = [(size, f) for size, f in zip(sizes, figs, strict=True) if f is not None]
        xs = [size for size, _ in points]
        ys = [f.median for _, f in points]
        errors = [[f.median - f.low for _, f in points], [f.high - f.median for _, f in points]]
        line = axes.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=contender)
        colors[contender] = line.lines[0].get_color()
    for contender in _contenders(results, "validated_s"):
        figs = [results.find("validated_s", contender, size) for size in sizes]
        medians = [(size, f.median) for size, f in zip(sizes, figs, strict=True) if f is not None]
        axes.plot(
            [size for size, _ in medians], [value for _, value in medians],
            linestyle=":", marker=".", color=colors.get(contender),
            label=f"{contender}: validated",
        )  # fmt: skip
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    # After set_yscale, which installs its own (10^x) formatters.
    seconds = FuncFormatter(lambda value, _: f"{value:g} s")
    axes.yaxis.set_major_formatter(seconds)
    axes.yaxis.set_minor_formatter(seconds)
    axes.tick_params(axis="y", which="minor", labelsize=7)
    axes.set_xticks(sizes, [f"{size} MB" for size in sizes])
    axes.set_xlabel("retained memory (image size)")
    axes.set_ylabel("seconds to first correct completion")
    axes.set_title("Time to serve: cold start vs restored copies (median, min-max)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def write(results: Results, docs: Path) -> list[Path]:
    """Write benchmarks.md, benchmarks.json and (with matplotlib) the plot into ``docs``."""
    docs.mkdir(parents=True, exist_ok=True)
    written = [docs / "benchmarks.json"]
    written[0].write_text(results.model_dump_json(indent=1) + "\n")
    has_plot = plot(results, docs / PLOT_NAME)
    if has_plot:
        written.append(docs / PLOT_NAME)
    (docs / "benchmarks.md").write_text(render(results, PLOT_NAME if has_plot else None))
    written.append(docs / "benchmarks.md")
    return written
