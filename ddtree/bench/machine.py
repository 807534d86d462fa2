"""What ran the benchmark (recorded with the numbers) and how much memory it took."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch


def reset_peak_memory(device: torch.device) -> None:
    """CUDA keeps a resettable peak per device; CPU RSS has no reset (see ``peak_memory_bytes``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory since the last reset, or the process's peak RSS on CPU.

    ``ru_maxrss`` is the high-water mark of the whole process (kilobytes on Linux, bytes on macOS), so on
    CPU it only grows during a run and cannot be attributed to one method.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def machine_info(device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    try:
        ddtree_version = version("ddtree")
    except PackageNotFoundError:  # running from a checkout that was never installed
        ddtree_version = None
    info = {
        "platform": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ddtree": ddtree_version,
        "git_commit": _git_commit(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "memory_kind": "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss",
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _git_commit() -> str | None:
    """The checkout's commit, when ddtree runs from one (read-only ``git rev-parse``)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
