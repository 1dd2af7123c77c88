"""Finding an activation's cgroup by its name and a process of its tree: on fake trees under
tmp_path (no root), both layouts."""

from __future__ import annotations

from pathlib import Path

from snapctl.cgroups import Limits, create_cgroup, detect_layout
from snapctl.cgroups.lookup import cgroup_named, proc_cgroup_path
from tests.cgroups.test_layout import V1_SELF, v1_tree, v2_tree


def test_v1_finds_the_cgroup_its_process_is_in(tmp_path: Path) -> None:
    layout = detect_layout(v1_tree(tmp_path / "cg"), V1_SELF)
    assert layout is not None
    made = create_cgroup("aaaa-copy-1", Limits(memory_bytes=512 << 20), layout=layout)
    assert made is not None
    (made.dirs["memory"] / "memory.usage_in_bytes").write_text("4096\n")
    inside = ("8:pids:/snapctl/aaaa-copy-1\n4:memory:/machine/abc/snapctl/aaaa-copy-1\n"
              "1:cpu,cpuacct:/snapctl/aaaa-copy-1\n0::/\n")  # fmt: skip

    found = cgroup_named("aaaa-copy-1", 10, layout=layout, proc_cgroup=inside)

    assert found is not None and found.path == made.path == "/machine/abc/snapctl/aaaa-copy-1"
    assert found.dirs == made.dirs
    usage = found.usage()
    assert (usage.memory_bytes, usage.memory_limit_bytes) == (4096, 512 << 20)
    # A process elsewhere (the supervisor, or a PID reused), or one gone: none.
    assert cgroup_named("aaaa-copy-1", 10, layout=layout, proc_cgroup=V1_SELF) is None
    assert cgroup_named("aaaa-copy-1", 10, layout=layout, proc_cgroup="") is None
    # A name nothing was made for (no cgroups here when the copy restored): none.
    assert cgroup_named("aaaa-copy-2", 10, layout=layout, proc_cgroup=inside) is None


def test_v2_finds_the_cgroup_with_no_limit(tmp_path: Path) -> None:
    root = v2_tree(tmp_path / "cg")
    layout = detect_layout(root, "0::/system.slice/snapctl-agent.service\n")
    assert layout is not None
    made = create_cgroup("aaaa-copy-1", Limits(), layout=layout)
    assert made is not None
    (made.dirs["unified"] / "memory.current").write_text("8192\n")
    (made.dirs["unified"] / "memory.max").write_text("max\n")

    found = cgroup_named("aaaa-copy-1", 10, layout=layout,
                         proc_cgroup="0::/system.slice/snapctl/aaaa-copy-1\n")  # fmt: skip

    assert found is not None and found.path == "/system.slice/snapctl/aaaa-copy-1"
    assert (found.memory_bytes(), found.memory_limit_bytes()) == (8192, None)


def test_proc_cgroup_lines() -> None:
    text = "12:cpu,cpuacct:/a\n4:memory:/b\n1:name=systemd:/c\n0::/d\n"
    assert proc_cgroup_path(text, "cpu") == "/a" and proc_cgroup_path(text, "memory") == "/b"
    assert proc_cgroup_path(text, "unified") == "/d" and proc_cgroup_path(text, "pids") is None
