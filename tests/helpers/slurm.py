"""A real single-node SLURM for tests: installed (Debian ``slurm-wlm`` + ``munge``) and started.

    cluster = start_slurm()             # pytest.skip(reason) only where that is impossible
    job = cluster.sbatch([...], env)    # job id
    cluster.wait(job, timeout=...)      # final state, e.g. "COMPLETED"
    cluster.stop()

The daemons run as root with a one-node configuration: every CPU of this machine, the node's
memory, one partition ``debug``, job requeue allowed. Daemons already running from an earlier
start are stopped and restarted with this configuration. ``stop()`` kills the daemons it started.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch")
CONF_DIR = "/etc/slurm"
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def _run(cmd: list[str], timeout: float = 60, check: bool = True, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


def _install() -> None:
    """apt-get the packages if a binary is missing; skip the test where that cannot be done."""
    if all(os.path.exists(b) for b in BINARIES):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root (apt-get slurm-wlm munge)")
    if shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and this is not a Debian/Ubuntu system (no apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if _run(install, timeout=900, check=False, env=env).returncode != 0:
        _run(["apt-get", "update"], timeout=900, env=env)
        _run(install, timeout=900, env=env)


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return int(total_kb / 1024 * 0.9)


def _slurm_conf(host: str, cpus: int) -> str:
    return (
        "\n".join(
            [
                "ClusterName=testcluster",
                f"SlurmctldHost={host}",
                "AuthType=auth/munge",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "ReturnToService=2",
                "SlurmctldPidFile=/run/slurmctld.pid",
                "SlurmdPidFile=/run/slurmd.pid",
                "SlurmdSpoolDir=/var/spool/slurmd",
                "StateSaveLocation=/var/spool/slurmctld",
                "SlurmUser=root",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "JobRequeue=1",
                "MpiDefault=none",
                "KillWait=30",
                "SchedulerParameters=defer_batch",
                "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
                "SlurmdLogFile=/var/log/slurm/slurmd.log",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                f"NodeName={host} CPUs={cpus} RealMemory={_memory_mb()} State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=NO",
            ]
        )
        + "\n"
    )


def _start_munge() -> None:
    for d in ("/etc/munge", "/run/munge", "/var/lib/munge", "/var/log/munge"):
        os.makedirs(d, exist_ok=True)
    key = "/etc/munge/munge.key"
    if not os.path.exists(key):
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
    _run(
        [
            "chown",
            "-R",
            "munge:munge",
            "/etc/munge",
            "/run/munge",
            "/var/lib/munge",
            "/var/log/munge",
        ]
    )
    os.chmod(key, 0o400)
    if _run(["pgrep", "-x", "munged"], check=False).returncode != 0:
        _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])


class Cluster:
    def __init__(self, host: str):
        self.host = host

    def sbatch(self, args: list[str], env: dict | None = None) -> str:
        r = _run(["sbatch", "--parsable", *args], env=env)
        return r.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        r = _run(["scontrol", "show", "job", job], check=False)
        for field in r.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job: str, name: str) -> str | None:
        r = _run(["scontrol", "show", "job", job], check=False)
        for field in r.stdout.split():
            if field.startswith(name + "="):
                return field.split("=", 1)[1]
        return None

    def wait(self, job: str, timeout: float, until=FINISHED.__contains__) -> str:
        """Poll until ``until(state)``; returns the state (fails the test on timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if until(state):
                return state
            time.sleep(1)
        _run(["scancel", job], check=False)
        pytest.fail(f"SLURM job {job} still {self.state(job)} after {timeout:.0f} s")

    def stop(self) -> None:
        for daemon in ("slurmd", "slurmctld"):
            _run(["pkill", "-x", daemon], check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _run(["pgrep", "-x", "slurmd|slurmctld"], check=False).returncode != 0:
                return
            time.sleep(0.2)


def _wait_for_node(deadline: float) -> None:
    while time.monotonic() < deadline:
        r = _run(["sinfo", "-h", "-o", "%T"], check=False)
        if r.returncode == 0 and r.stdout.strip() in ("idle", "mixed", "allocated"):
            return
        time.sleep(1)
    log = open("/var/log/slurm/slurmctld.log").read()[-2000:]
    raise RuntimeError(f"the SLURM node did not come up: sinfo says {r.stdout!r}\n{log}")


def start_slurm() -> Cluster:
    """Install if needed, write the one-node configuration, (re)start munge and the daemons."""
    _install()
    host = socket.gethostname().split(".")[0]
    cluster = Cluster(host)
    cluster.stop()
    shutil.rmtree("/var/spool/slurmctld", ignore_errors=True)  # a clean queue for the tests
    for d in (CONF_DIR, "/var/spool/slurmctld", "/var/spool/slurmd", "/var/log/slurm"):
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(CONF_DIR, "slurm.conf"), "w") as f:
        f.write(_slurm_conf(host, os.cpu_count() or 1))
    _start_munge()
    for daemon in ("slurmctld", "slurmd"):
        _run([f"/usr/sbin/{daemon}", "-c"])  # -c: no state from an earlier start
    _wait_for_node(time.monotonic() + 60)
    return cluster
