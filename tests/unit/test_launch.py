"""Rank and rendezvous from torchrun's, SLURM's or no environment, and each process's GPU."""

import pytest

from megatron_tempnet.distributed.launch import (
    DeviceBindingError,
    first_host,
    launch_environment,
    local_device_index,
)


def test_torchrun_environment_is_kept():
    assert launch_environment({"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "x"}) == {}


def test_slurm_environment_gives_ranks_and_rendezvous():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "8(x2)",
        "SLURM_JOB_NODELIST": "gpu[003-004,010]",
        "SLURM_JOB_ID": "123456",
    }
    got = launch_environment(env)
    assert got == {
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu003",
        "MASTER_PORT": str(29500 + 3456),
    }
    assert launch_environment({**env, "MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"


def test_alone_is_rank_zero_of_one():
    got = launch_environment({})
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"]) == ("0", "1", "0")
    assert got["MASTER_ADDR"] == "127.0.0.1" and int(got["MASTER_PORT"]) > 0


def test_first_host_of_node_lists():
    assert first_host("node1") == "node1"
    assert first_host("node1,node2") == "node1"
    assert first_host("gpu[07-09]") == "gpu07"
    assert first_host("rack-a[1,3-5],rack-b2") == "rack-a1"


def test_each_process_finds_its_own_gpu():
    """torchrun shows every GPU of the node to every process (LOCAL_RANK picks one); srun
    --gpus-per-task 1 shows each process its own GPU only, as index 0, whatever its LOCAL_RANK
    (set_device(LOCAL_RANK) failed there)."""
    assert [local_device_index(r, 8, 8) for r in range(8)] == list(range(8))
    assert [local_device_index(r, 1, 8) for r in range(8)] == [0] * 8
    with pytest.raises(DeviceBindingError) as e:
        local_device_index(3, 2, 4)
    assert str(e.value) == (
        "LOCAL_RANK 3 of 4 processes on this node, but 2 GPUs are visible to it: start one "
        "process per GPU (torchrun --nproc-per-node 2, or srun --ntasks-per-node 2 "
        "--gpus-per-task 1)"
    )
    with pytest.raises(DeviceBindingError, match="no GPU is visible"):
        local_device_index(0, 0)


class _OneGpuPerTask:
    """torch.cuda and torch.distributed as rank 3 of 8 on a node sees them under ``srun
    --gpus-per-task 1``: one visible GPU, ``cuda:0``; the process group is recorded, not made."""

    def __init__(self, monkeypatch):
        import torch
        import torch.distributed as dist

        self.devices_set, self.groups = [], []
        env = {"RANK": "3", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "8"}
        for name, value in {**env, "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "set_device", self.devices_set.append)
        monkeypatch.setattr(dist, "init_process_group", self._init)
        monkeypatch.setattr(dist, "is_initialized", lambda: bool(self.groups))
        monkeypatch.setattr(dist, "get_backend", lambda group=None: self.groups[0][0])

    def _init(self, backend, *, device_id=None, **kwargs):  # DeepSpeed reads the signature
        self.groups.append((backend, device_id))

    def deepspeed_as_on_cuda(self, monkeypatch) -> None:
        """DeepSpeed's comm layer with its CUDA accelerator, and no backend yet."""
        import importlib

        import torch
        from deepspeed.comm import comm

        ds_torch = importlib.import_module("deepspeed.comm.torch")  # not the torch it imports

        class CudaAccelerator:
            def device_name(self, index=None):
                return "cuda"

            def device(self, index):
                return torch.device("cuda", index)

            def communication_backend_name(self):
                return "nccl"

            def create_op_builder(self, name):
                return None

        for module in (comm, ds_torch):
            monkeypatch.setattr(module, "get_accelerator", CudaAccelerator)
        monkeypatch.setattr(comm, "cdb", None)


def test_one_gpu_per_task_binds_every_call_to_the_visible_gpu(monkeypatch):
    """DeepSpeed's own ``init_distributed`` binds NCCL to ``cuda:LOCAL_RANK`` (cuda:3, which does
    not exist where each task sees one GPU); the group made first by ``init_default_group`` is on
    cuda:0, and DeepSpeed adopts it without making another."""
    from datetime import timedelta

    import deepspeed
    import torch

    from megatron_tempnet.distributed.launch import init_default_group

    alone = _OneGpuPerTask(monkeypatch)
    alone.deepspeed_as_on_cuda(monkeypatch)
    deepspeed.init_distributed(dist_backend="nccl")
    assert alone.groups == [("nccl", torch.device("cuda", 3))]  # the failure this avoids

    ours = _OneGpuPerTask(monkeypatch)
    ours.deepspeed_as_on_cuda(monkeypatch)
    assert init_default_group(timedelta(minutes=1)) == 0
    deepspeed.init_distributed(dist_backend="nccl")
    assert ours.groups == [("nccl", torch.device("cuda", 0))]
    assert ours.devices_set == [0]


def test_a_loopback_host_name_across_hosts_is_named_before_gloo_waits():
    """Debian's /etc/hosts maps the host's name to 127.0.1.1: gloo would listen there, and the
    other hosts' connections to a checkpoint's group would fail or wait for its timeout."""
    from megatron_tempnet.distributed.launch import gloo_interface_problem, node_count

    loopback, routable = (lambda host: ["127.0.1.1"]), (lambda host: ["10.1.2.3", "127.0.1.1"])
    two_nodes = {"SLURM_PROCID": "9", "SLURM_NNODES": "2"}
    torchrun_two = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert node_count(two_nodes) == 2 and node_count(torchrun_two) == 2
    assert node_count({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == 1
    assert node_count({"WORLD_SIZE": "8"}) is None
    problem = gloo_interface_problem(two_nodes, "gpu017", loopback)
    assert problem.startswith(
        "this job spans several hosts, and this host's name gpu017 resolves to 127.0.1.1, a "
        "loopback address: gloo (checkpoints) would listen there"
    )
    assert "GLOO_SOCKET_IFNAME" in problem
    assert gloo_interface_problem(torchrun_two, "gpu017", loopback) == problem
    assert gloo_interface_problem({**two_nodes, "GLOO_SOCKET_IFNAME": "ib0"}, "g", loopback) is None
    assert gloo_interface_problem(two_nodes, "gpu017", routable) is None
    assert gloo_interface_problem({"SLURM_PROCID": "0", "SLURM_NNODES": "1"}, "w", loopback) is None
