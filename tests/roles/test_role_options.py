"""Role option plumbing without processes: specs_for gives multi-rank roles a place to form their
process group, and option dicts become engine / sampling configs or clear errors."""

from __future__ import annotations

import pytest

from hfrt.session import specs_for


def test_multi_rank_roles_get_one_dist_master_and_single_ranks_none() -> None:
    specs = specs_for({
        "actor": {"impl": "actor", "world_size": 2, "options": {"model": "tiny"}},
        "critic": {"impl": "critic", "world_size": 2, "options": {"dist_master": "10.0.0.1:29500"}},
        "reward": {"impl": "reward"},
    })
    actor = [s for s in specs if s.role == "actor"]
    assert len({s.options["dist_master"] for s in actor}) == 1
    host, port = actor[0].options["dist_master"].split(":")
    assert host == "127.0.0.1" and int(port) > 0 and actor[0].options["model"] == "tiny"
    assert all(s.options["dist_master"] == "10.0.0.1:29500" for s in specs if s.role == "critic")
    assert "dist_master" not in next(s for s in specs if s.role == "reward").options


def test_option_dicts_become_configs_or_name_the_bad_field() -> None:
    pytest.importorskip("transformers")
    from hfrt.roles.common import engine_config, sampling_params

    config = engine_config({"backend": "fsdp2", "optim": {"lr": 3e-4, "betas": [0.9, 0.95]}}, trainable=False)
    assert config.backend == "fsdp2" and config.optim.betas == (0.9, 0.95) and not config.trainable
    params = sampling_params({"temperature": 0.7, "stop_token_ids": [5, 6]}, n=4)
    assert params.n == 4 and params.stop_token_ids == (5, 6) and params.temperature == 0.7
    with pytest.raises(ValueError, match=r"engine.optim: unknown field\(s\) \['learning_rate'\]"):
        engine_config({"optim": {"learning_rate": 1.0}})
    with pytest.raises(ValueError, match=r"sampling: unknown field\(s\) \['max_tokens'\]"):
        sampling_params(max_tokens=3)
