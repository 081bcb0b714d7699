"""The calling thread's name where the OS shows it (`top -H`, `ps -L`, py-spy, Activity
Monitor, Linux's /proc/<pid>/task/<tid>/comm).

Python 3.11 names its threads for Python alone, so every thread of a replica reads as
"python" (or the Ray worker's title) to the OS. The engine thread named there is what lets a
benchmark split the replica's CPU into decode's loop and the rest (`load/harness/process_cpu.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15  # linux/prctl.h
_LINUX_MAX = 15  # bytes, before the terminating NUL


def name_os_thread(name: str) -> bool:
    """Name the calling thread; whether the OS took it. Best effort: a name is diagnostics."""
    raw = name.encode()[:_LINUX_MAX if sys.platform.startswith("linux") else 63]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if sys.platform.startswith("linux"):
            return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
        if sys.platform == "darwin":  # macOS names only the calling thread: one argument
            return libc.pthread_setname_np(ctypes.c_char_p(raw)) == 0
    except (OSError, AttributeError):
        pass
    return False
