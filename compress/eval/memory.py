"""Peak memory of this process, as every benchmark and transform report states it."""

from __future__ import annotations

from pathlib import Path


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes: VmHWM from /proc, else ``ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
