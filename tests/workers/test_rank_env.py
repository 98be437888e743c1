"""The DISAGG_TP_* contract: what a rank reads, and errors that name the variable."""

import pytest

from workers.rank_env import RankEnv, from_environ


def _env(**overrides):
    env = {
        "DISAGG_TP_SIZE": "4", "DISAGG_TP_RANK": "2", "DISAGG_TP_LOCAL_RANK": "1",
        "DISAGG_TP_MASTER_ADDR": "10.0.0.7", "DISAGG_TP_MASTER_PORT": "29500",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_unset_size_means_no_external_ranks():
    assert from_environ({"DISAGG_TP_RANK": "1"}) is None


def test_reads_every_variable_and_round_trips():
    env = from_environ(_env())
    assert env == RankEnv(rank=2, world_size=4, local_rank=1, master_addr="10.0.0.7", master_port=29500)
    assert not env.is_leader
    assert from_environ(env.to_environ()) == env


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"DISAGG_TP_RANK": None}, "DISAGG_TP_RANK"),
        ({"DISAGG_TP_RANK": "4"}, "DISAGG_TP_RANK"),
        ({"DISAGG_TP_SIZE": "0"}, "DISAGG_TP_SIZE"),
        ({"DISAGG_TP_SIZE": "two"}, "DISAGG_TP_SIZE"),
        ({"DISAGG_TP_LOCAL_RANK": "-1"}, "DISAGG_TP_LOCAL_RANK"),
        ({"DISAGG_TP_MASTER_ADDR": " "}, "DISAGG_TP_MASTER_ADDR"),
        ({"DISAGG_TP_MASTER_PORT": "65536"}, "DISAGG_TP_MASTER_PORT"),
        ({"DISAGG_TP_MASTER_PORT": None}, "DISAGG_TP_MASTER_PORT"),
    ],
)
def test_errors_name_the_variable(overrides, named):
    with pytest.raises(ValueError, match=named):
        from_environ(_env(**overrides))
