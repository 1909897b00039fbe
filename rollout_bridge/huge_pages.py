"""Run the job with glibc's malloc on transparent huge pages (`glibc.malloc.hugetlb=1`).

XLA:CPU gives every execution of a program one temporary buffer, allocated when the call
starts and freed when it ends (the benchmark learner step, model M on 16 x 256 tokens:
716 MB). glibc serves an allocation that large with a fresh `mmap` and returns it with
`munmap`, so each call touches every page of it anew: one page fault per 4 KiB, ~175,000
per step of that benchmark. With
the glibc tunable `glibc.malloc.hugetlb=1` (glibc >= 2.35) malloc marks such mappings
`MADV_HUGEPAGE`, and the kernel faults them in 2 MiB pages instead (where transparent huge
pages are not `never`). Figures: docs/PERFORMANCE.md, "Page faults of XLA's buffers".

glibc reads its tunables once, when the process starts, so `train.py` re-executes itself
with the tunable added (`reexec_with_huge_pages`, before any heavy import): the same
interpreter, the same command line, the same environment plus `GLIBC_TUNABLES`. Nothing
happens where it cannot apply (not Linux, not glibc >= 2.35, transparent huge pages
`never`), where the user set `glibc.malloc.hugetlb` already, or with `SPOPP_HUGE_PAGES=0`.
Code that calls our jitted functions from its own process sets the variable itself:
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python my_script.py`.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
OPT_OUT_ENV = "SPOPP_HUGE_PAGES"  # "0": run without the tunable
THP_MODE_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)  # the first glibc with glibc.malloc.hugetlb


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library this process runs on, None if it is not glibc."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):  # not glibc (musl, macOS, Windows)
        return None


def transparent_huge_page_mode(path: str = THP_MODE_PATH) -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never": the
    bracketed word of `path`), None where the file is missing or unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_tunables(environ: Mapping[str, str], glibc: tuple[int, int] | None,
                       thp_mode: str | None) -> str | None:
    """The `GLIBC_TUNABLES` value to run with, or None when nothing should change: the
    user's own tunables (colon-separated, kept as given) plus `SETTING`. None when
    ``environ`` opts out (`OPT_OUT_ENV` = "0"), already names `TUNABLE`, the C library is
    not glibc >= `MIN_GLIBC`, or transparent huge pages are off or unknown."""
    if environ.get(OPT_OUT_ENV, "1").strip() == "0":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if any(item.split("=", 1)[0] == TUNABLE for item in current.split(":")):
        return None
    if glibc is None or glibc < MIN_GLIBC or thp_mode not in ("always", "madvise"):
        return None
    return f"{current}:{SETTING}" if current else SETTING


def reexec_with_huge_pages() -> None:
    """Replace this process by the same command with `huge_page_tunables` in its
    environment, when they change anything (the re-executed process finds the tunable set
    and returns). Call first thing in a script's main block: work done before is lost."""
    if sys.platform != "linux":
        return
    tunables = huge_page_tunables(os.environ, glibc_version(), transparent_huge_page_mode())
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    environ = dict(os.environ, GLIBC_TUNABLES=tunables)
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError as error:  # the job still runs, on 4 KiB pages
        print(f"warning: could not restart with GLIBC_TUNABLES={tunables} ({error}); running "
              f"without huge pages", file=sys.stderr)


__all__ = [
    "MIN_GLIBC",
    "OPT_OUT_ENV",
    "SETTING",
    "TUNABLE",
    "glibc_version",
    "huge_page_tunables",
    "reexec_with_huge_pages",
    "transparent_huge_page_mode",
]
