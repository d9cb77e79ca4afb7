"""Engines' heaps on transparent huge pages (bakeoff/host/hugepages.py): the switches, and that they work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bakeoff.api.errors import UserError
from bakeoff.host import envs, hugepages

GLIBC = (2, 36)


def test_the_hosts_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hugepages.thp_mode(f) == "always"
    f.write_text("garbage\n")
    assert hugepages.thp_mode(f) is None
    for odd in (b"always [madvis\xe9] never", b"] always [madvise] never", b"[ madvise ] never", b"[sometimes]"):
        f.write_bytes(odd)
        assert hugepages.thp_mode(f) == ("madvise" if b"madvise ]" in odd or b"[madvise]" in odd else None), odd
    assert hugepages.thp_mode(tmp_path / "missing") is None


def test_madvise_hosts_get_both_switches_and_a_users_tunables_are_kept():
    extra, why = hugepages.engine_env({}, True, mode="madvise", glibc=GLIBC)
    assert extra == {"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert "madvise" in why and "glibc 2.36" in why
    extra, _ = hugepages.engine_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, True, mode="madvise", glibc=GLIBC)
    assert extra["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # a user who set the malloc switch themselves keeps their value
    extra, why = hugepages.engine_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, True, mode="madvise", glibc=GLIBC)
    assert "GLIBC_TUNABLES" not in extra and "glibc.malloc.hugetlb=0 as set" in why
    # a tunable whose name only contains the switch's is not the switch
    extra, _ = hugepages.engine_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb_x=1"}, True, mode="madvise", glibc=GLIBC)
    assert extra["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb_x=1:glibc.malloc.hugetlb=1"
    extra, why = hugepages.engine_env({"THP_MEM_ALLOC_ENABLE": "0"}, True, mode="madvise", glibc=GLIBC)
    assert "THP_MEM_ALLOC_ENABLE" not in extra and "THP_MEM_ALLOC_ENABLE=0 as set" in why


@pytest.mark.parametrize("environ, mode, glibc, says", [
    ({"BAKEOFF_HUGE_PAGES": "off"}, "madvise", GLIBC, "off ($BAKEOFF_HUGE_PAGES=off)"),
    ({}, "never", GLIBC, "'never'"),
    ({}, "always", GLIBC, "'always'"),
    ({}, None, GLIBC, "no transparent huge pages"),
])
def test_nothing_is_asked_where_it_cannot_or_need_not_be(environ, mode, glibc, says):
    extra, why = hugepages.engine_env(environ, True, mode=mode, glibc=glibc)
    assert extra == {} and says in why


def test_an_engine_that_does_not_want_them_asks_only_when_told_to():
    extra, why = hugepages.engine_env({}, False, mode="madvise", glibc=GLIBC)
    assert extra == {} and why.startswith("not asked")
    extra, _ = hugepages.engine_env({"BAKEOFF_HUGE_PAGES": "on"}, False, mode="madvise", glibc=GLIBC)
    assert extra["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    extra, _ = hugepages.engine_env({"BAKEOFF_HUGE_PAGES": "auto"}, True, mode="madvise", glibc=GLIBC)
    assert "GLIBC_TUNABLES" in extra


def test_an_old_glibc_gets_the_torch_switch_only_and_says_why():
    extra, why = hugepages.engine_env({}, True, mode="madvise", glibc=(2, 31))
    assert extra == {"THP_MEM_ALLOC_ENABLE": "1"} and "glibc 2.31 is older than 2.35" in why


def test_engine_children_inherit_the_switches(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda path=None: "madvise")
    monkeypatch.setattr(hugepages, "glibc_version", lambda: GLIBC)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("BAKEOFF_HUGE_PAGES", raising=False)
    env = envs.child_env({"X": "1"}, huge_pages=True)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["THP_MEM_ALLOC_ENABLE"] == "1" and env["X"] == "1"
    assert "GLIBC_TUNABLES" not in envs.child_env(huge_pages=False)  # an engine that does not want them
    monkeypatch.setenv("BAKEOFF_HUGE_PAGES", "on")
    assert "GLIBC_TUNABLES" in envs.child_env(huge_pages=False)  # ... unless told to
    assert "GLIBC_TUNABLES" not in envs.child_env()  # exports: never
    monkeypatch.setenv("BAKEOFF_HUGE_PAGES", "off")
    assert "GLIBC_TUNABLES" not in envs.child_env(huge_pages=True)
    monkeypatch.setenv("BAKEOFF_HUGE_PAGES", "disabled")  # not a value: one line that says what to do
    with pytest.raises(UserError, match="BAKEOFF_HUGE_PAGES='disabled' is not one of auto, on, off"):
        envs.child_env(huge_pages=True)
    assert "GLIBC_TUNABLES" not in envs.child_env()  # exports do not read it


ALLOCATE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from bakeoff.host.hugepages import anon_huge_pages
block = bytearray(96 * 2**20)  # one malloc, served by mmap
for i in range(0, len(block), 4096):
    block[i] = 1
print(json.dumps(anon_huge_pages([os.getpid()])))
"""


def _huge_mib(env: dict[str, str]) -> float:
    root = os.path.dirname(os.path.dirname(os.path.abspath(hugepages.__file__)))
    out = subprocess.run([sys.executable, "-c", ALLOCATE, os.path.dirname(root)], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)[0]


def test_the_malloc_switch_puts_a_large_allocation_on_huge_pages_and_without_it_none_are():
    """A real process on this host: 96 MiB from malloc, touched, then its own ``AnonHugePages``."""
    mode, glibc = hugepages.thp_mode(), hugepages.glibc_version()
    if mode != "madvise" or glibc is None or glibc < hugepages.MIN_GLIBC:
        pytest.skip(f"needs THP mode 'madvise' and glibc >= 2.35 (this host: mode {mode!r}, glibc {glibc})")
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "BAKEOFF_HUGE_PAGES")}
    extra, _ = hugepages.engine_env(base, True)
    assert _huge_mib({**base, **extra}) >= 32  # most of the 96 MiB
    assert _huge_mib(base) == 0  # madvise mode: nothing without asking


def test_anon_huge_pages_reads_this_process_and_skips_gone_ones():
    got = hugepages.anon_huge_pages([os.getpid(), 2**22 + 7])
    assert got is not None and got[1] > 0
    assert hugepages.anon_huge_pages([2**22 + 7]) is None


def assert_engine_heap_on_huge_pages(notes: dict[str, str]) -> None:
    """A started engine's (one that wants them) ``huge_pages`` note: what was asked, and where malloc was
    asked, pages that show it."""
    pages = notes["huge_pages"]
    extra, why = hugepages.engine_env(wanted=True)
    assert pages.startswith(why), pages
    if "GLIBC_TUNABLES" in extra:  # the engine processes hold huge pages after loading
        assert float(pages.split("AnonHugePages ")[1].split()[0]) > 0, pages
