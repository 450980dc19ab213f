"""Where this process sits in the job: torchrun's variables, SLURM's (``srun``), or alone.

torch.distributed reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. torchrun sets them; under ``srun`` they are derived from SLURM's own variables
(the rendezvous is the first node of the allocation); a process started alone is rank 0 of 1.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta

from megatron_tempnet.utils.cli import UserError

DEFAULT_PORT = 29500


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-010,012],cpu1`` -> ``gpu003``."""
    first = re.match(r"[^,\[]+(\[[^\]]*\])?", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    entry = first.group(0)
    if "[" not in entry:
        return entry
    prefix, ranges = entry.split("[", 1)
    start = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables to add to ``env`` (nothing when torchrun set them)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return {}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0"))
        return {
            "RANK": env["SLURM_PROCID"],
            "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
            "MASTER_ADDR": env.get("MASTER_ADDR")
            or first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost"))),
            # one port per job, so that jobs sharing a node do not collide
            "MASTER_PORT": env.get("MASTER_PORT") or str(DEFAULT_PORT + job % 10000),
        }
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": env.get("MASTER_PORT") or str(_free_port()),
    }


class DeviceBindingError(UserError, ValueError):
    """This process cannot tell which visible GPU is its own; the message says how to launch."""


def local_device_index(local_rank: int, visible: int, local_world_size: int | None = None) -> int:
    """The index, among the GPUs this process sees, of its own GPU.

    torchrun, and srun with ``--gpus-per-node``, show every GPU of the node to every process:
    ``LOCAL_RANK`` picks one. srun with ``--gpus-per-task=1`` (or a ``CUDA_VISIBLE_DEVICES`` set
    per process) shows each process its own GPU only, as index 0, whatever its ``LOCAL_RANK``.
    """
    if visible < 1:
        raise DeviceBindingError("no GPU is visible to this process (CUDA_VISIBLE_DEVICES)")
    if visible == 1:
        return 0
    if local_rank < visible and (local_world_size is None or local_world_size <= visible):
        return local_rank
    raise DeviceBindingError(
        f"LOCAL_RANK {local_rank} of {local_world_size or '?'} processes on this node, but "
        f"{visible} GPUs are visible to it: start one process per GPU (torchrun "
        f"--nproc-per-node {visible}, or srun --ntasks-per-node {visible} --gpus-per-task 1)"
    )


def bind_device() -> int | None:
    """Make this process's own GPU the current one (before NCCL's first use); returns its
    index among the visible GPUs, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = local_device_index(
        int(os.environ.get("LOCAL_RANK", 0)),
        torch.cuda.device_count(),
        int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None,
    )
    torch.cuda.set_device(index)
    return index


def init_default_group(timeout: timedelta | None = None) -> int | None:
    """torch.distributed's default group (NCCL on this process's own GPU, gloo without CUDA),
    created before DeepSpeed's ``init_distributed``, which then adopts it. Returns the GPU's
    index among the visible ones (None without CUDA).

    DeepSpeed would create the group itself with ``device_id=cuda:LOCAL_RANK`` whenever the
    world has more than one process: under ``srun --gpus-per-task 1`` (each process sees its
    own GPU only, as ``cuda:0``) ``LOCAL_RANK`` 3 names a device that does not exist there. The
    group is bound to the device ``bind_device`` chose instead, as Megatron-LM binds it.
    """
    import torch
    import torch.distributed as dist

    device = bind_device()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    options = {} if timeout is None else {"timeout": timeout}  # None: torch's default
    if device is not None and world > 1:  # NCCL's communicators on the right GPU from the start
        options["device_id"] = torch.device("cuda", device)
    dist.init_process_group("nccl" if device is not None else "gloo", **options)
    return device


class GlooInterfaceError(UserError, RuntimeError):
    """gloo would listen on a loopback address in a job that spans several hosts."""


def node_count(env: Mapping[str, str]) -> int | None:
    """Hosts of the job: SLURM's node count under srun, torchrun's world over its local world
    (None when neither says)."""
    if "SLURM_PROCID" in env and env.get("SLURM_NNODES", "").isdigit():
        return int(env["SLURM_NNODES"])
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return -(-int(world) // int(local))
    return None


def gloo_interface_problem(
    env: Mapping[str, str],
    host: str | None = None,
    resolve: Callable[[str], list[str]] | None = None,
) -> str | None:
    """Why gloo cannot connect this host to the others, or None.

    Checkpoints exchange over gloo (``GLOO_SOCKET_IFNAME`` picks its network interface). Without
    it, gloo listens on the first address its host's name resolves to; Debian's and Ubuntu's
    ``/etc/hosts`` map the name to ``127.0.1.1``, a loopback address the other hosts cannot
    reach, and their connections fail or wait for the group's timeout.
    """
    if env.get("GLOO_SOCKET_IFNAME") or (node_count(env) or 1) < 2:
        return None
    host = host or socket.gethostname()
    try:
        addresses = (resolve or _addresses)(host)
    except OSError:
        return None  # torch.distributed says so itself, when it first needs the address
    if not addresses or not ipaddress.ip_address(addresses[0]).is_loopback:
        return None
    return (
        f"this job spans several hosts, and this host's name {host} resolves to "
        f"{addresses[0]}, a loopback address: gloo (checkpoints) would listen there, out of the "
        "other hosts' reach; set GLOO_SOCKET_IFNAME to the network interface NCCL uses (e.g. "
        "export GLOO_SOCKET_IFNAME=ib0; `ip -brief address` lists them), or map the name to a "
        "routable address in /etc/hosts"
    )


def _addresses(host: str) -> list[str]:
    """``host``'s addresses in the order the resolver gives them (gloo takes the first)."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return [info[4][0].split("%")[0] for info in infos]
