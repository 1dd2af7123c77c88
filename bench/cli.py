"""``python -m bench``: parse, run the plan (or load a saved run), print or write the docs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.results import Results

DOCS = Path(__file__).resolve().parent.parent / "docs"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure how fast a snapctl copy serves, against a cold start and bare "
        "CRIU (needs root and CRIU >= 4.2).",
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 MB only, 3 repetitions (about a minute)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON record")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help=f"write benchmarks.md, benchmarks.json and benchmarks.png into {DOCS}",
    )
    parser.add_argument(
        "--from-json", type=Path, help="render a saved run (benchmarks.json) instead of measuring"
    )
    parser.add_argument(
        "--sizes", type=_sizes, help="retained MB to measure, comma-separated (default 64,512,2048)"
    )
    parser.add_argument("--reps", type=int, help="repetitions per size (default 7; --quick 3)")
    parser.add_argument("--work-dir", type=Path, help="parent of the scratch directory (/tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="real vLLM instead (scripts/setup --vllm): cold start against plain and lazy "
        "copies of the same server, with the donor's and a bare dump's frozen time",
    )
    parser.add_argument(
        "--model-sizes",
        type=_model_sizes,
        help="with --vllm: instead, per model size (tiny, or GB of weights, e.g. tiny,0.5,2.9) "
        "the cold start and a warm completion, capture-ready, the image, plain, lazy and pooled "
        "copies, a bare criu restore and the PSS of 1 and 3 parked copies",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=Path("/var/tmp/snapctl-bench-models"),
        help="with --model-sizes: where the generated models are kept between runs "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--frozen-pairs",
        type=_positive,
        default=1,
        help="with --vllm: donors to launch, each dumped by snapctl and by bare CRIU at the "
        "same barrier, in turns first (default 1)",
    )
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _model_sizes(text: str) -> list[str]:
    from bench.sizes import parse_sizes

    try:
        return parse_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("sizes are positive integers, e.g. 64,512")
    return sizes


def _vllm(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from bench import vllm
    from bench.run import workdir
    from snapctl.criu import find_criu
    from snapctl.supervision.process import become_subreaper

    become_subreaper()
    if args.model_sizes:
        from bench import sizes

        reps = args.reps or 3
        with workdir(args.work_dir, args.keep) as work:
            say(f"scratch directory {work}")
            found = sizes.run(find_criu(), work, args.models_dir, args.model_sizes, reps, say)
        if args.json:
            sys.stdout.write(json.dumps([dataclasses.asdict(r) for r in found]) + "\n")
        else:
            sys.stdout.write(sizes.render(found, reps))
        return 0
    with workdir(args.work_dir, args.keep) as work:
        say(f"scratch directory {work}")
        results = vllm.run(find_criu(), work, args.reps or 3, say, args.frozen_pairs)
    if args.json:
        sys.stdout.write(json.dumps(dataclasses.asdict(results)) + "\n")
    else:
        sys.stdout.write(vllm.render(results))
    return 0


def say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        results = Results.model_validate_json(args.from_json.read_bytes())
    else:
        if os.geteuid() != 0:
            say("error: needs root (CRIU restores into new namespaces)")
            return 2
        from bench.machine import compile_bytecode
        from bench.plan import full, quick
        from bench.run import Runner, workdir

        compile_bytecode()

        if args.vllm:
            return _vllm(args)
        plan = quick() if args.quick else full()
        if args.sizes:
            plan.sizes_mb = plan.donor_sizes_mb = args.sizes
            plan.concurrency_mb = args.sizes[len(args.sizes) // 2]
        if args.reps:
            plan.reps = args.reps
        with workdir(args.work_dir, args.keep) as work:
            say(f"scratch directory {work}")
            results = Runner(plan, work, say).run()
    if args.write_docs:
        from bench.docs import write

        for path in write(results, DOCS):
            say(f"wrote {path}")
    if args.json:
        sys.stdout.write(results.model_dump_json() + "\n")
    elif not args.write_docs:
        from bench.docs import render

        sys.stdout.write(render(results, None))
    failed = [t.name for t in results.targets if not t.met]
    say(f"{len(results.targets) - len(failed)}/{len(results.targets)} targets met")
    return 0
