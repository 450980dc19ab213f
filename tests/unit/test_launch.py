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
