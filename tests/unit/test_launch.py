"""Rank and rendezvous from torchrun's, SLURM's or no environment."""

from megatron_tempnet.distributed.launch import first_host, launch_environment


def test_torchrun_environment_is_kept():
    assert launch_environment({"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "x"}) == {}


def test_slurm_environment_gives_ranks_and_rendezvous():
    env = {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "gpu[003-004,010]",
        "SLURM_JOB_ID": "123456",
    }  # fmt: skip
    got = launch_environment(env)
    assert got == {
        "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu003", "MASTER_PORT": str(29500 + 3456),
    }  # fmt: skip
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
