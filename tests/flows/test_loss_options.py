"""Update options declared once (hfrt/loss_options.py) and refused before launch: unknown keys,
bad values and wrong types name what was wrong and list every accepted option, on the flow
config side and on the daemon side alike."""

from __future__ import annotations

import pytest

from hfrt.flows.grpo_family import GRPOFlowConfig, RLOOConfig, actor_loss_options
from hfrt.flows.ppo_family import PPOConfig
from hfrt.flows.recipes.dapo import DAPOConfig
from hfrt.wire.loss_options import ActorLoss, CriticLoss, UpdateSchedule, accepted_options, check_update_options

SCHEDULE = ("ppo_epochs", "ppo_mini_batch_size", "micro_batch_size")


def test_every_accepted_option_is_listed_when_one_is_unknown() -> None:
    with pytest.raises(ValueError) as err:
        check_update_options("actor", {"clip_ratio": 0.2, "ppo_epochs": 2})
    message = str(err.value)
    assert message.startswith("actor.update: unknown option(s) ['clip_ratio']; accepted: ")
    for name in accepted_options("actor"):
        assert name in message
    assert set(SCHEDULE) | {"policy_loss_mode", "tis_cap", "loss_agg_mode", "kl_loss_type"} <= set(accepted_options("actor"))
    with pytest.raises(ValueError, match=r"critic.update: unknown option\(s\) \['entropy_coeff'\]; accepted: cliprange_value, "):
        check_update_options("critic", {"entropy_coeff": 0.1})
    with pytest.raises(ValueError, match="no update options for role 'reward'"):
        check_update_options("reward", {})


@pytest.mark.parametrize(("options", "message"), [
    ({"policy_loss_mode": "ppo"}, "policy_loss_mode='ppo': use one of vanilla, gspo, cispo"),
    ({"loss_agg_mode": "mean"}, "loss_agg_mode='mean': use one of token-mean, "),
    ({"kl_loss_type": "k4"}, "kl_loss_type='k4': use one of kl, "),
    ({"clip_ratio_c": 1.0}, "clip_ratio_c=1.0: the dual-clip bound must be > 1"),
    ({"tis_cap": 0}, "tis_cap=0.0: the truncation cap must be > 0"),
    ({"policy_loss_mode": "decoupled"}, "policy_loss_mode='decoupled' needs tis_cap"),
    ({"ppo_epochs": 0}, "ppo_epochs=0: must be at least 1"),
    ({"micro_batch_size": 0}, "micro_batch_size=0: must be at least 1"),
    ({"entropy_coeff": True}, "entropy_coeff=True must be float"),
    ({"ppo_epochs": 1.5}, "ppo_epochs=1.5 must be int"),
    ({"use_kl_loss": 1}, "use_kl_loss=1 must be bool"),
    ({"clip_ratio_c": "3"}, "clip_ratio_c='3' must be float or None"),
    ({"kl_loss_coef": float("nan")}, "kl_loss_coef=nan must be finite"),
])
def test_bad_values_and_types_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match="accepted|must be") as err:
        check_update_options("actor", options)
    assert message in str(err.value)


def test_good_options_parse_with_ints_as_floats() -> None:
    schedule, loss = check_update_options("actor", {
        "policy_loss_mode": "gspo", "tis_cap": 2, "clip_ratio_c": None, "ppo_epochs": 2, "micro_batch_size": 4,
    })
    assert schedule == UpdateSchedule(ppo_epochs=2, micro_batch_size=4)
    assert loss == ActorLoss(policy_loss_mode="gspo", tis_cap=2.0, clip_ratio_c=None)
    assert isinstance(loss.tis_cap, float)
    assert check_update_options("actor", {"policy_loss_mode": "decoupled", "tis_cap": 2})[1].policy_loss_mode == "decoupled"
    assert check_update_options("critic", {"cliprange_value": None})[1] == CriticLoss(cliprange_value=None)


def test_daemons_use_the_same_declaration() -> None:
    from hfrt.roles import actor, critic
    from hfrt.roles.training import updates

    assert actor.ActorLoss is ActorLoss and critic.CriticLoss is CriticLoss and updates.UpdateSchedule is UpdateSchedule


def test_flow_configs_merge_mode_tis_and_tables_into_update_options() -> None:
    cfg = GRPOFlowConfig.read({"policy_loss_mode": "cispo", "tis_cap": 2, "actor_loss": {"clip_ratio_high": 0.28}})
    options = actor_loss_options(cfg)
    assert options["policy_loss_mode"] == "cispo" and options["tis_cap"] == 2.0
    assert options["clip_ratio_high"] == 0.28 and options["use_kl_loss"] is True
    assert "tis_cap" not in actor_loss_options(GRPOFlowConfig.read({}))  # 0: off
    # the table wins over the flow's own settings; DAPO's clip-higher is its own setting
    dapo = DAPOConfig.read({"actor_loss": {"clip_ratio_high": 0.3}}).actor_update_options()
    assert dapo["clip_ratio_high"] == 0.3 and dapo["clip_ratio_low"] == 0.2
    ppo = PPOConfig.read({"critic_loss": {"loss_agg_mode": "seq-mean-token-mean"}})
    assert ppo.critic_update_options() == {
        "ppo_epochs": 1, "ppo_mini_batch_size": 0, "cliprange_value": 0.5, "loss_agg_mode": "seq-mean-token-mean"}
    assert RLOOConfig.read({"ppo_epochs": 2}).actor_update_options()["ppo_epochs"] == 2
    for config in (cfg, ppo):
        for role, options in (("actor", config.actor_update_options()), ("critic", config.critic_update_options())):
            check_update_options(role, options)  # what a flow sends, the daemon accepts


@pytest.mark.parametrize(("config", "message"), [
    ({"actor_loss": {"bogus": 1}}, r"config: actor.update: unknown option\(s\) \['bogus'\]; accepted: .*micro_batch_size"),
    ({"critic_loss": {"cliprange_value": -1}}, "config: critic.update: option cliprange_value=-1.0: must be at least 0"),
    ({"policy_loss_mode": "ppo"}, "policy_loss_mode='ppo': use one of vanilla, gspo, cispo"),
    ({"loss_agg_mode": "x"}, "loss_agg_mode='x'"),
    ({"kl_loss_type": "x"}, "kl_loss_type='x'"),
    ({"tis_cap": -1}, "tis_cap=-1.0: must not be negative"),
    ({"policy_loss_mode": "decoupled"}, "policy_loss_mode='decoupled' needs tis_cap"),
    ({"actor_loss": 3}, "config actor_loss=3: expected a table"),
    ({"actor_loss": {1: 2}}, "expected a table"),
])
def test_flow_configs_refuse_bad_update_options(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GRPOFlowConfig.read(config)


# -------------------------------------------------------------------- verl's newer modes and the advantage table


def test_new_modes_and_rollout_correction_options_parse() -> None:
    from hfrt.wire.loss_options import POLICY_LOSS_MODES

    assert {"sapo", "gpg", "geo_mean", "clip_cov", "kl_cov", "reinforce"} <= set(POLICY_LOSS_MODES)
    _, loss = check_update_options("actor", {
        "policy_loss_mode": "reinforce", "bypass_mode": True, "rollout_is": "sequence", "rollout_is_threshold": 5,
        "rollout_is_batch_normalize": True, "rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2,0.01",
        "loss_seed": 7, "tau_pos": 1, "keep_loss_agg_mode": True,
    })
    assert loss.rollout_is_threshold == 5.0 and loss.reads_rollout_log_probs and loss.loss_seed == 7
    assert check_update_options("actor", {"rollout_rs": "seq_sum_k2", "rollout_rs_threshold": 2})[1].rollout_rs_threshold == 2.0
    assert not ActorLoss().reads_rollout_log_probs


@pytest.mark.parametrize(("options", "message"), [
    ({"policy_loss_mode": "ppo"}, "use one of vanilla, gspo, cispo, decoupled, sapo, gpg, geo_mean, clip_cov, kl_cov, reinforce"),
    ({"rollout_is": "tokens"}, "rollout_is='tokens': use one of token, sequence"),
    ({"rollout_rs": "token_k9", "rollout_rs_threshold": 2}, "rollout_rs='token_k9': use one or more"),
    ({"rollout_rs": "token_k1"}, "needs rollout_rs_threshold"),
    ({"rollout_rs": "seq_max_k2", "rollout_rs_threshold": "0.1_2"}, "is not a threshold for seq_max_k2"),
    ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize=True needs rollout_is"),
    ({"bypass_mode": True, "policy_loss_mode": "gspo"}, "bypass_mode=True works with policy_loss_mode vanilla"),
    ({"bypass_mode": True, "tis_cap": 2}, "use rollout_is for the weights"),
    ({"tau_neg": 0}, "tau_neg=0.0: must be > 0"),
    ({"clip_cov_lb": 5, "clip_cov_ub": 1}, "lb must be < ub"),
    ({"loss_seed": 1.5}, "loss_seed=1.5 must be int"),
])
def test_bad_new_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_update_options("actor", options)
    assert message in str(err.value)


def test_the_advantage_table_selects_an_estimator_before_launch() -> None:
    from hfrt.flows.recipes.remax import ReMaxConfig

    cfg = GRPOFlowConfig.read({"advantage": {"estimator": "opo"}, "policy_loss_mode": "sapo"})
    assert cfg.advantage_call(estimator="grpo", norm_adv_by_std=False) == {"estimator": "opo", "norm_adv_by_std": False}
    assert GRPOFlowConfig.read({}).advantage_call(estimator="grpo") == {"estimator": "grpo"}
    otb = GRPOFlowConfig.read({"advantage": {"estimator": "optimal_token_baseline"}})
    assert otb.log_prob_options() == {"sum_pi_squared": True} and not otb.on_policy(8)  # the Σπ² pass is not skipped
    assert GRPOFlowConfig.read({}).on_policy(8)
    bypass = GRPOFlowConfig.read({"ppo_epochs": 2, "actor_loss": {"bypass_mode": True}})
    assert bypass.on_policy(8) and not GRPOFlowConfig.read({"ppo_epochs": 2}).on_policy(8)  # bypass: no old-log-prob pass
    assert PPOConfig.read({"advantage": {"estimator": "gae", "lam": 0.9}}).advantage == {"estimator": "gae", "lam": 0.9}
    assert ReMaxConfig.read({"advantage": {"estimator": "remax"}}).advantage["estimator"] == "remax"
    assert PPOConfig.read({"advantage": {"estimator": "reinforce_plus_plus"}}).CRITIC


@pytest.mark.parametrize(("cls", "config", "message"), [
    ("grpo", {"advantage": {"estimator": "ppo"}}, "estimator='ppo': use one of gae, grpo"),
    ("grpo", {"advantage": {"gama": 1.0}}, "unknown option(s) ['gama']"),
    ("grpo", {"n": 1, "advantage": {"estimator": "opo"}}, "estimator='opo' compares a prompt's samples, so it needs n >= 2 (n=1)"),
    ("ppo", {"advantage": {"estimator": "grpo_passk"}}, "needs n >= 2 (n=1)"),
    ("grpo", {"advantage": {"estimator": "gae"}}, "estimator='gae' needs values (a critic)"),
    ("rloo", {"advantage": {"estimator": "remax"}}, "estimator='remax' needs a greedy baseline score"),
])
def test_advantage_tables_a_flow_cannot_run_are_refused(cls: str, config: dict, message: str) -> None:
    classes = {"grpo": GRPOFlowConfig, "ppo": PPOConfig, "rloo": RLOOConfig}
    with pytest.raises(ValueError) as err:
        classes[cls].read(config)
    assert message in str(err.value) and "(from the advantage table)" in str(err.value)
