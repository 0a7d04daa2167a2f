"""On-policy distillation's advantage (estimator on_policy_distill): per response token the
teacher's log-prob minus the student's, plus reward_coef × the sequence's score, less each
position's batch mean (the baseline, on by default); through the
actor's compute_advantages it reads the teacher's column (a reference's `ref_log_prob` by default)
and the student's `old_log_probs`, else the sampler's `rollout_log_probs`, and reports the reverse
KL to the teacher as kl/mean. By hand; no daemon."""

from __future__ import annotations

import pytest
import torch

from hfrt.daemon.batch import Batch
from hfrt.roles.components.advantage import Advantages
from hfrt.roles.losses.distill import compute_on_policy_distill_advantage

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
TEACHER = torch.tensor([[-0.1, -0.5, -9.0], [-2.0, -0.2, -0.3]])
STUDENT = torch.tensor([[-0.4, -0.5, -1.0], [-1.0, -0.7, -0.3]])
SCORES = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.1]])  # a score at each last response token


def test_the_advantage_is_teacher_minus_student_per_token() -> None:
    adv, returns = compute_on_policy_distill_advantage(SCORES, MASK, TEACHER, STUDENT, baseline=False)
    assert torch.allclose(adv, torch.tensor([[0.3, 0.0, 0.0], [-1.0, 0.5, 0.0]])) and torch.equal(adv, returns)


def test_the_baseline_is_each_positions_mean_over_the_rows_there() -> None:
    adv, _ = compute_on_policy_distill_advantage(SCORES, MASK, TEACHER, STUDENT)
    # position 0: 0.3 and -1.0 (mean -0.35); position 1: 0.0 and 0.5 (mean 0.25); position 2: one row, 0.0
    assert torch.allclose(adv, torch.tensor([[0.65, -0.25, 0.0], [-0.65, 0.25, 0.0]]))


def test_the_task_reward_is_mixed_in_at_every_token() -> None:
    adv, _ = compute_on_policy_distill_advantage(SCORES, MASK, TEACHER, STUDENT, reward_coef=0.5, baseline=False)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.5, 0.0], [-0.95, 0.55, 0.05]]))


@pytest.mark.parametrize("student", ["old_log_probs", "rollout_log_probs"])
def test_compute_advantages_reads_the_teacher_and_the_student(student: str) -> None:
    batch = Batch({"response_mask": MASK, "token_level_scores": SCORES, student: STUDENT, "ref_log_prob": TEACHER})
    out = Advantages().compute(batch, estimator="on_policy_distill", distill_baseline=False)
    assert torch.allclose(out["advantages"], torch.tensor([[0.3, 0.0, 0.0], [-1.0, 0.5, 0.0]]))
    kl = float(((STUDENT - TEACHER) * MASK).sum() / MASK.sum())
    assert out.meta["metrics"]["kl/mean"] == pytest.approx(kl)  # the student's reverse KL to the teacher


def test_another_teacher_column_and_a_missing_one_is_named() -> None:
    batch = Batch({"response_mask": MASK, "token_level_scores": SCORES, "old_log_probs": STUDENT, "teacher_lp": TEACHER})
    out = Advantages().compute(batch, estimator="on_policy_distill", teacher_column="teacher_lp", distill_reward_coef=0.5,
                               distill_baseline=False)
    assert torch.allclose(out["advantages"][1], torch.tensor([-0.95, 0.55, 0.05]))
    with pytest.raises(KeyError, match=r"compute_advantages\(on_policy_distill\) needs tensor column\(s\) \['ref_log_prob'\]"):
        Advantages().compute(batch, estimator="on_policy_distill")
