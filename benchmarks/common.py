"""What the benchmarks share: peak memory above a baseline, the machine's description, and the
glibc settings under which a CPU process's resident memory follows its live tensors."""

from __future__ import annotations

import os
import platform

import torch

# glibc maps every allocation of 1 MiB or more on its own and returns it when freed: the process's
# resident memory (and its high-water mark) then follows the live tensors
GLIBC_RETURNS_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 20),
}


class Memory:
    """Peak memory above a baseline, on CPU (process RSS high-water mark) or GPU."""

    def __init__(self, device):
        self.device = torch.device(device)

    @staticmethod
    def _status_kb(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
        raise RuntimeError(f"{key} missing from /proc/self/status")

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = self._status_kb("VmRSS") * 1024

    def peak_mb(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        return (self._status_kb("VmHWM") * 1024 - self.base) / 2**20


def machine(device) -> str:
    if str(device) == "cuda":
        return torch.cuda.get_device_name(0)
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.python_version()}"
    )


def write_json(path: str, args, targets, **sections) -> None:
    """A benchmark's results as JSON: the machine, its arguments, ``sections`` and the targets
    (``(check, value, limit, passed)`` rows)."""
    import json

    rows = [dict(check=d, value=v, limit=lim, passed=ok) for d, v, lim, ok in targets]
    record = {"machine": machine(args.device), "args": vars(args), **sections, "targets": rows}
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
