"""Transparent huge pages for the engines' heaps: the CPU engines' weights and KV caches on 2 MiB pages.

A CPU engine streams its weights through the cores once per decode step, so the TLB misses of 4 KiB
pages are a large part of a step. Linux backs anonymous memory with transparent huge pages (THP)
when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, or, in ``madvise`` mode (this
project's hosts, Debian's and Ubuntu's kernels), only where the process asks with
``madvise(MADV_HUGEPAGE)``, which ONNX Runtime, OpenVINO and torch's CPU allocator do not do by
default. Two documented switches make them ask, with no root and no host change:

- ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc >= 2.35, the ``glibc.malloc.hugetlb`` tunable):
  malloc madvises its mmap'd chunks and aligns its heap for THP; ONNX Runtime's and OpenVINO's CPU
  allocators get their memory from malloc.
- ``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator (``c10/core/alloc_cpu.cpp``) aligns
  allocations of 2 MiB and more to 2 MiB and madvises them.

Measured on this project's 2-core AVX-512 host (2026-12-05, SmolLM2-135M-Instruct, bare loops of
``benchmarks/fidelity_bare.py``, 1 thread, 4 requests x 64 tokens, three fresh processes each way):
OpenVINO GenAI's ContinuousBatchingPipeline 33.6-34.9 -> 44.1-48.1 tok/s at 1 session and
201-223 -> 244-282 at 8; optimum-onnx's ORTModelForCausalLM.generate 22.5-24.4 -> 29.0-30.9 tok/s;
transformers (torch eager) 17.1-17.5 -> 17.2-17.9. An engine measured on 4 KiB pages is measured
below what it can do on the same host. Not every engine gains: huge pages cost a 2 MiB fault (and,
in ``madvise`` mode, a synchronous compaction) for every fresh large allocation, so code that
allocates and frees large temporaries per step pays more than it saves. The same day, bare loops:
ORT GenAI int4 (og.Generator) 88-89 -> 122 tok/s at 1 session but equal at 8 (210), with its TTFT
624-628 -> 742-774 ms; inside ``bakeoff qualify`` (one run each way) transformers' 8-session peak
104 -> 97 tok/s, vLLM CPU 182 -> 187 with its start 86 -> 102 s, engine starts and exports 3-9 s
slower each. So a backend asks only where it measured a gain at 1 and 8 sessions
(:attr:`backends._server.ChildServerBackend.huge_pages`: OpenVINO GenAI and optimum-onnx), and
only for its serving process (not exports); ``$BAKEOFF_HUGE_PAGES=on`` asks for every engine,
``off`` for none. The run's notes say what was asked (``huge_pages``, with the engine processes'
``AnonHugePages`` after start); ``benchmarks/bench_fidelity.py`` gives each engine's own loop
the environment bakeoff gives that engine, so that its ratios measure bakeoff's serving path,
not the page size.

Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
OPT_OUT = "BAKEOFF_HUGE_PAGES"
GLIBC_HUGETLB = "glibc.malloc.hugetlb"
MIN_GLIBC = (2, 35)  # the first glibc with the glibc.malloc.hugetlb tunable


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The host's THP mode (``always``, ``madvise`` or ``never``: the bracketed word), None without THP."""
    try:
        with open(path, "rb") as f:
            text = f.read(200).decode("ascii", errors="replace")
    except OSError:
        return None
    start = text.find("[")
    end = text.find("]", start + 1)
    word = text[start + 1:end].strip() if 0 <= start < end else ""
    return word if word in ("always", "madvise", "never") else None


def glibc_version() -> tuple[int, int] | None:
    """This interpreter's glibc as ``(major, minor)`` (engine environments share the host's), None elsewhere."""
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()[:2]
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (ValueError, OSError, AttributeError):
        return None


CHOICES = ("auto", "on", "off")


def setting(environ: dict[str, str]) -> str | None:
    """``$BAKEOFF_HUGE_PAGES`` as ``auto`` (unset or empty), ``on`` or ``off``; None for any other value."""
    value = environ.get(OPT_OUT, "").strip().lower() or "auto"
    value = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(value, value)
    return value if value in CHOICES else None


def engine_env(environ: dict[str, str] | None = None, wanted: bool = False, mode: str | None = "read",
               glibc: tuple[int, int] | None | str = "read") -> tuple[dict[str, str], str]:
    """The variables that put an engine's heap on huge pages, and what they do here (for the notes).

    Args:
        environ: the environment the engine would inherit (default: this process's); a
            ``GLIBC_TUNABLES`` already in it is kept and extended, and one that sets
            ``glibc.malloc.hugetlb`` itself is left as the user set it. ``$BAKEOFF_HUGE_PAGES``:
            ``auto`` (default: ``wanted``), ``on`` (every engine), ``off`` (none).
        wanted: the engine's default (its backend's :attr:`huge_pages`: measured to gain).
        mode: the host's THP mode (default: read from sysfs).
        glibc: glibc's ``(major, minor)`` (default: this interpreter's).

    Returns:
        ``(variables to add, reason)``; no variables when not wanted, without THP, in ``never``
        mode (nothing can ask) or ``always`` mode (nothing needs to).
    """
    environ = dict(os.environ) if environ is None else environ
    choice = setting(environ)
    if choice is None:
        raise ValueError(f"{OPT_OUT}={environ.get(OPT_OUT)!r} is not one of {', '.join(CHOICES)}; unset it for auto")
    if choice == "off":
        return {}, f"off (${OPT_OUT}={environ[OPT_OUT]}): the engine's heap on the host's default pages"
    if choice != "on" and not wanted:
        return {}, (f"not asked: this engine's default (measured no gain, or a loss; ${OPT_OUT}=on asks "
                    "for every engine; bakeoff/host/hugepages.py)")
    mode = thp_mode() if mode == "read" else mode
    glibc = glibc_version() if glibc == "read" else glibc
    if mode is None:
        return {}, "no transparent huge pages on this host"
    if mode != "madvise":
        return {}, f"the host's THP mode is {mode!r}: nothing for the engine to ask"
    extra: dict[str, str] = {}
    if "THP_MEM_ALLOC_ENABLE" in environ:
        said = [f"THP_MEM_ALLOC_ENABLE={environ['THP_MEM_ALLOC_ENABLE']} as set"]
    else:
        extra["THP_MEM_ALLOC_ENABLE"] = "1"
        said = ["THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator)"]
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0].strip() == GLIBC_HUGETLB for t in tunables.split(":")):
        said.append(f"GLIBC_TUNABLES={tunables} as set")
    elif glibc is not None and glibc >= MIN_GLIBC:
        extra["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, f"{GLIBC_HUGETLB}=1") if t)
        said.append(f"{GLIBC_HUGETLB}=1 (malloc; glibc {glibc[0]}.{glibc[1]})")
    else:
        said.append("no malloc switch (glibc " + (".".join(map(str, glibc)) if glibc else "unknown") + " is older than 2.35)")
    why = "this engine's default" if wanted and choice != "on" else f"${OPT_OUT}={environ.get(OPT_OUT)}"
    return extra, f"asked ({why}); host THP mode 'madvise'; huge pages for the engine: " + ", ".join(said)


def anon_huge_pages(pids: list[int]) -> tuple[float, float] | None:
    """``(AnonHugePages MiB, Rss MiB)`` summed over ``pids`` (``/proc/<pid>/smaps_rollup``), None when none reads."""
    huge = rss = 0.0
    read = False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                text = f.read(8192).decode("ascii", errors="replace")
        except OSError:
            continue
        read = True
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("AnonHugePages", "Rss"):
                try:
                    kib = max(0.0, float(value.split()[0])) if value.split() else 0.0
                except ValueError:  # not the kernel's format: not a figure
                    continue
                if key == "Rss":
                    rss += kib / 1024
                else:
                    huge += kib / 1024
    return (round(huge, 1), round(rss, 1)) if read else None
