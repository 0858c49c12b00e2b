"""Where ranks started by srun alone (Hydra's submitit launcher) find each other."""

import pytest

from dgc.distributed import SLURM_PORT_BASE, first_slurm_host, slurm_master_env


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("vm", "vm"),
        ("node7", "node7"),
        ("gpu[07-09,12]", "gpu07"),
        ("gpu[12,07-09]", "gpu12"),
        ("gpu[001-004],cpu[1-2]", "gpu001"),
        ("a1,b[1-3]", "a1"),
        ("rack[1-2]-n[3-4]", "rack1-n3"),
        ("n[1-2].cluster.org", "n1.cluster.org"),
        (" node-a ", "node-a"),
    ],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize("bad", ["", "gpu[01-03", "[]"])
def test_first_slurm_host_rejects_garbage(bad):
    with pytest.raises(ValueError, match="Slurm node list"):
        first_slurm_host(bad)


def test_srun_ranks_get_master_from_the_node_list_and_job_id():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "gpu[04-05]", "SLURM_JOB_ID": "123456"}
    assert slurm_master_env(env) == {"MASTER_ADDR": "gpu04", "MASTER_PORT": str(SLURM_PORT_BASE + 3456)}
    # every rank of the job computes the same pair
    assert slurm_master_env({**env, "SLURM_PROCID": "0"}) == slurm_master_env(env)


def test_exported_master_and_torchrun_win():
    base = {"SLURM_PROCID": "0", "SLURM_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    assert slurm_master_env({**base, "MASTER_ADDR": "10.0.0.1"}) == {"MASTER_PORT": str(SLURM_PORT_BASE + 7)}
    assert slurm_master_env({**base, "MASTER_ADDR": "h", "MASTER_PORT": "1234"}) == {}
    # under torchrun (RANK set) torchrun's own rendezvous is used
    assert slurm_master_env({**base, "RANK": "0"}) == {}
    assert slurm_master_env({"MASTER_ADDR": "x"}) == {}
    # the job list is used when there is no step list
    assert slurm_master_env({"SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "c[3,5]", "SLURM_JOBID": "2"}) == {
        "MASTER_ADDR": "c3",
        "MASTER_PORT": str(SLURM_PORT_BASE + 2),
    }
