"""``snapctl pool set/ls/rm``: the agent's warm pool of parked copies (needs the agent)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from snapctl.cli._activation_options import cgroup_limit_options
from snapctl.cli.remote import agent_client, call
from snapctl.plain import emit_json, print_table

if TYPE_CHECKING:
    from snapctl.agent.client import AgentClient


def parse_bytes(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``4G``, ``512M``, ``1048576``: a size in bytes (the cgroup limits' spelling)."""
    from snapctl.cgroups.limits import parse_size

    if value is None:
        return None
    try:
        return parse_size(value, least=1)
    except ValueError as error:
        raise click.BadParameter(str(error)) from error


def _client() -> AgentClient:
    from snapctl.agent.errors import AgentUnavailableError

    client = agent_client()
    if client is None:
        raise AgentUnavailableError(
            "the pool lives in the agent, and none answers: start it (snapctl agent, or "
            "systemctl start snapctl-agent)"
        )
    return client


def _image(value: str) -> str:
    return str(Path(value).absolute())


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    from snapctl.plain import mib

    return mib(value)


@click.group()
def pool() -> None:
    """Keep copies of an image parked, ready to activate (agent).

    A parked copy is restored ahead of time and waits at the activation barrier; snapctl copy
    --image takes one when it is ready and only activates, probes and publishes it.
    """


@pool.command("set")
@click.option("--image", required=True, metavar="DIR", help="A published image directory.")
@click.option("--size", required=True, type=click.IntRange(0, 64),
              help="Parked copies to keep (refilled in the background).")  # fmt: skip
@click.option(
    "--lazy/--no-lazy",
    default=None,
    help="Restore the parked copies lazily (default: as snapctl copy decides).",
)
@click.option(
    "--max-memory",
    callback=parse_bytes,
    metavar="SIZE",
    help="Most memory this image's parked copies may hold together (512M, 4G).",
)
@cgroup_limit_options
@click.option("--json", "as_json", is_flag=True, help="Print the target as one JSON object.")
def set_target(image: str, size: int, lazy: bool | None, max_memory: int | None,
               memory_bytes: int | None, cpus: float | None, as_json: bool) -> None:  # fmt: skip
    """Keep SIZE copies of an image parked (0: none)."""
    body = {"image": _image(image), "size": size, "lazy": lazy, "max_memory": max_memory,
            "memory_bytes": memory_bytes, "cpus": cpus}  # fmt: skip
    target = call(_client(), "POST", "/pool/set", body)
    if as_json:
        emit_json(target, sort_keys=False)
        return
    click.echo(
        f"{target['image']}: keeping {target['size']} parked "
        f"({_lazy(target['lazy'])}, memory budget {_size(target['max_memory'])}"
        f"{_limits(target)})"
    )


def _limits(target: dict[str, Any]) -> str:
    """Each parked copy's cgroup limits, as the target line says them ("" for none)."""
    from snapctl.cgroups.limits import format_size

    memory, cpus = target.get("memory_bytes"), target.get("cpus")
    parts = [f"--memory {format_size(memory)}"] if memory else []
    parts += [f"--cpus {cpus:g}"] if cpus else []
    return f", each copy {' '.join(parts)}" if parts else ""


def _lazy(value: bool | None) -> str:
    return {None: "lazy by default", True: "lazy", False: "not lazy"}[value]


@pool.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def list_pool(as_json: bool) -> None:
    """List the pool's images and their parked copies (age, memory, state, cgroup)."""
    listing: dict[str, Any] = call(_client(), "GET", "/pool")
    if as_json:
        emit_json(listing, sort_keys=False)
        return
    rows = []
    for entry in listing["entries"]:
        target = entry["target"]
        parked = entry["parked"]
        ready = sum(1 for row in parked if row["state"] == "parked")
        rows.append([
            target["image"], f"{ready}/{target['size']}", _lazy(target["lazy"]),
            _size(entry["memory_bytes"]), _size(target["max_memory"]), "", "", "", "", "", "",
            entry.get("last_failure") or "",
        ])  # fmt: skip
        for row in parked:
            rows.append(["", "", "", _size(row["memory_bytes"]), "", row["id"], row["state"],
                         f"{row['age_s']:.0f} s", *_cgroup(row), ""])  # fmt: skip
    columns = ("image", "parked", "restore", "memory", "budget", "copy", "state", "age",
               "cgroup", "charged", "limit", "last failure")  # fmt: skip
    print_table(columns, rows)
    ksm = listing.get("ksm")
    if ksm is not None:
        click.echo(_describe_ksm(ksm))


def _cgroup(row: dict[str, Any]) -> list[str]:
    """A parked copy's cgroup, what it is charged and its memory limit (rows from an agent
    older than these columns have none)."""
    if not row.get("cgroup"):
        return ["-", "-", "-"]
    limit = row.get("memory_limit_bytes")
    return [row["cgroup"], _size(row.get("cgroup_memory_bytes")),
            "none" if limit is None else _size(limit)]  # fmt: skip


def _describe_ksm(ksm: dict[str, Any]) -> str:
    """The host's :class:`snapctl.supervision.memory.KsmStatus`, in a line."""
    if not ksm["running"]:
        return "KSM stopped: parked copies share no pages (snapctl agent --share-memory)"
    return (
        f"KSM running: {ksm['saved_bytes'] / 2**30:.2f} GiB saved by "
        f"{ksm['pages_sharing']} shared pages"
    )


@pool.command("rm")
@click.option("--image", required=True, metavar="DIR", help="The image to stop keeping parked.")
@click.option("--json", "as_json", is_flag=True, help="Print the removed target as JSON.")
def remove(image: str, as_json: bool) -> None:
    """Stop keeping copies of an image parked, and discard its parked copies."""
    target = call(_client(), "POST", "/pool/rm", {"image": _image(image)})
    if as_json:
        emit_json(target, sort_keys=False)
        return
    click.echo(f"{target['image']}: removed from the pool; its parked copies were discarded")
