"""What every benchmark and study records about where it ran, and how it starts its child processes.

One copy for ``bench.run`` (the step-time suite) and the studies (``bench.tying``, ``bench.synthetic``,
``bench.audit``): :func:`machine_info` (CPU, memory, GPU, package versions; with ``threads`` also what torch sees
in a throwaway child), :func:`git_info` (the commit and the uncommitted changes under the paths the numbers depend
on) and :func:`child_environment` (the environment of a measured child process). Standard library only: a study's
parent process never imports torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
"""The repository root (where children run and git is asked)."""

PACKAGES = ("torch", "transformers", "lightning", "opacus", "peft", "gguf")
"""The packages whose installed versions every record names."""

DISTRIBUTED_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
)
"""torch.distributed's environment, which a measured child never inherits (each is a process group of its own)."""


def version(package: str) -> str | None:
    """The installed version of ``package`` (``None``: not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model_and_memory() -> tuple[str, int]:
    """This machine's CPU model name (``"unknown"`` when not listed) and total memory in KiB, from /proc."""
    cpu_model = "unknown"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as meminfo:
        total_kib = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
    return cpu_model, total_kib


def gpu_name() -> str | None:
    """The GPU(s) nvidia-smi lists (``None``: no nvidia-smi, or no GPU)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def torch_view(threads: int, device: str) -> dict[str, Any]:
    """What torch sees with ``threads`` threads on ``device``, asked of a throwaway child (this process stays small).

    Returns ``torch_threads`` (torch's intra-op thread count after ``set_num_threads(threads)``; 0: its default),
    ``cuda_device`` and ``cuda_version`` (``None`` on the CPU or with ``device`` "cpu").
    """
    probe = (
        "import json, torch\n"
        f"t = {int(threads)}\n"
        "if t: torch.set_num_threads(t)\n"
        f"cuda = torch.cuda.is_available() and {device!r} != 'cpu'\n"
        "print(json.dumps({'torch_threads': torch.get_num_threads(),\n"
        "  'cuda_device': torch.cuda.get_device_name() if cuda else None,\n"
        "  'cuda_version': torch.version.cuda if cuda else None}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine_info(threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """CPU, memory, GPU (nvidia-smi), platform and the versions of :data:`PACKAGES`.

    Args:
        threads: also record what torch sees with this many threads on ``device`` (:func:`torch_view`: a child
            process that imports torch); ``None``: not asked (a study's arms record their own thread count).
        device: the device the measured children use (``"cpu"``, ``"cuda"``, ``"auto"``), with ``threads``.
    """
    cpu_model, total_kib = cpu_model_and_memory()
    info: dict[str, Any] = {
        "cpu_model": cpu_model,
        "logical_cpus": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(total_kib / 2**20, 1),
        "gpu": gpu_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{package: version(package) for package in PACKAGES},
    }
    if threads is not None:
        info.update(torch_view(threads, device))
    return info


def machine_description(info: dict[str, Any]) -> str:
    """:func:`machine_info`'s record in one line: CPU, logical CPUs, memory, GPU and the main package versions.

    Args:
        info: a :func:`machine_info` record (``cpu_model``, ``logical_cpus``, ``memory_gib``, ``gpu`` and the versions
            of torch, transformers, lightning and opacus).
    """
    return (
        f"{info['cpu_model']}, {info['logical_cpus']} logical CPUs, {info['memory_gib']} GiB"
        + (f", GPU {info['gpu']}" if info.get("gpu") else ", no GPU")
        + f"; torch {info['torch']}, transformers {info['transformers']}, lightning {info['lightning']}, "
        f"opacus {info['opacus']}"
    )


def git_info(*paths: str) -> dict[str, Any]:
    """The commit, and the uncommitted changes under ``paths`` (what the numbers depend on; default: everything).

    Returns ``commit`` (the full HEAD; empty outside a git checkout), ``uncommitted_changes`` (``git status
    --porcelain`` lines) and ``describe`` (the short commit, "+ uncommitted changes" when there are any).
    """

    def git(*command: str) -> str:
        try:
            done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, check=False)
        except OSError:  # no git
            return ""
        return done.stdout if done.returncode == 0 else ""

    head = git("rev-parse", "HEAD").strip()
    dirty = [line for line in git("status", "--porcelain", "--", *paths).splitlines() if line.strip()]
    where = f" in {', '.join(paths)}" if paths else ""
    return {
        "commit": head,
        "uncommitted_changes": dirty,
        "describe": head[:12] + (f" + uncommitted changes{where}" if dirty else ""),
    }


def child_environment(threads: int = 0) -> dict[str, str]:
    """This environment for a child started as ``python -m ...`` with the repository root as its working directory.

    The root is then the first entry of the child's import path, so ``bench`` and ``tests.helpers`` import from this
    checkout with nothing added to PYTHONPATH.

    With ``threads`` > 0 also OMP_NUM_THREADS: Lightning's DDP-based strategies (DPStrategy is one) otherwise reset
    torch's thread count to cpu_count // processes on CPU, whatever ``torch.set_num_threads`` said before.
    Each call also gives the child a free MASTER_PORT of its own and none of this process' torch.distributed
    variables: DPStrategy opens a process group even on one device, and children running side by side (a study's
    ``--jobs``), or started from a process that already ran one (Lightning exports MASTER_PORT), would otherwise
    bind one port.
    """
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    environment = {
        **inherited,
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": str(free_port()),
    }
    if threads > 0:
        environment["OMP_NUM_THREADS"] = str(threads)
    return environment


def free_port() -> int:
    """A TCP port the operating system reports free now (it hands out distinct ones to calls close in time).

    Not Lightning's ``find_free_network_port``: that returns ``STANDALONE_PORT`` when set, one port for every child.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
