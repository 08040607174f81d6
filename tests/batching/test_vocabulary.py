"""The batch-size vocabulary: consistent configurations and what they derive, inconsistent ones and their messages."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proctor.batching.vocabulary import ROLES, BatchPlan, derive_batch_plan

BASE: dict[str, Any] = {
    "global_batch_size": 8,
    "mini_batch_size": 4,
    "num_generations": 4,
    "dp_size": 2,
    "micro_batch_size": 4,
}


def config(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


@pytest.mark.parametrize(
    ("kwargs", "derived"),
    [
        pytest.param(
            BASE,
            {
                "pairs_per_iteration": 32,
                "pairs_per_update": 16,
                "pairs_per_update_per_rank": 8,
                "updates_per_iteration": 2,
                "gradient_accumulation_steps": 2,
                "actor_rollout_dispatch_size": 16,
                "actor_logprob_dispatch_size": 16,
                "actor_update_dispatch_size": 16,
                "ref_dispatch_size": 16,
                "reward_dispatch_size": 32,
                "adv_dispatch_size": 32,
                "reward_is_model": False,
                "rollout_micro_batch_size": 4,
                "ref_micro_batch_size": 4,
                "old_micro_batch_size": 4,
                "service_batch_size": 4,
                "service_target_prompts": 1,
                "on_policy": False,
            },
            id="off-policy-defaults",
        ),
        pytest.param(
            config(mini_batch_size=8, num_generations=8, dp_size=4),
            {
                "pairs_per_iteration": 64,
                "pairs_per_update": 64,
                "pairs_per_update_per_rank": 16,
                "updates_per_iteration": 1,
                "gradient_accumulation_steps": 4,
                "actor_update_dispatch_size": 16,
                "reward_dispatch_size": 64,
                "service_batch_size": 4,
                "service_target_prompts": 1,
                "on_policy": True,
            },
            id="on-policy",
        ),
        pytest.param(
            config(rollout_micro_batch_size=8, ref_micro_batch_size=16, role_dp_sizes={"reward": 2}),
            {
                "reward_is_model": True,
                "reward_dispatch_size": 16,
                "ref_dispatch_size": 16,
                "old_micro_batch_size": 4,
                "service_batch_size": 16,
                "service_target_prompts": 4,
            },
            id="reward-model-and-forward-micros",
        ),
        pytest.param(
            {"global_batch_size": 6, "mini_batch_size": 2, "num_generations": 3, "dp_size": 3, "micro_batch_size": 2},
            {
                "pairs_per_iteration": 18,
                "pairs_per_update_per_rank": 2,
                "updates_per_iteration": 3,
                "gradient_accumulation_steps": 1,
                "actor_rollout_dispatch_size": 6,
                "service_batch_size": 2,
                "service_target_prompts": 2,
            },
            id="odd-group-size",
        ),
        pytest.param(
            config(
                global_batch_size=16,
                mini_batch_size=8,
                dp_size=4,
                micro_batch_size=2,
                role_dp_sizes={"actor_rollout": 8, "ref": 2, "actor_logprob": 16},
            ),
            {
                "pairs_per_iteration": 64,
                "pairs_per_update_per_rank": 8,
                "gradient_accumulation_steps": 4,
                "actor_rollout_dispatch_size": 8,
                "actor_logprob_dispatch_size": 4,
                "ref_dispatch_size": 32,
                "actor_update_dispatch_size": 16,
                "service_target_prompts": 1,
            },
            id="per-role-dp",
        ),
        pytest.param(
            {
                "global_batch_size": 4,
                "mini_batch_size": 4,
                "num_generations": 3,
                "dp_size": 1,
                "micro_batch_size": 2,
                "rollout_micro_batch_size": 6,
                "ref_micro_batch_size": 4,
                "old_micro_batch_size": 2,
            },
            {"gradient_accumulation_steps": 6, "service_batch_size": 12, "service_target_prompts": 4},
            id="service-lcm-6-4-2",
        ),
        pytest.param(
            {"global_batch_size": 1, "mini_batch_size": 1, "num_generations": 1, "dp_size": 1, "micro_batch_size": 1},
            {
                "pairs_per_iteration": 1,
                "gradient_accumulation_steps": 1,
                "updates_per_iteration": 1,
                "service_target_prompts": 1,
            },
            id="all-ones",
        ),
    ],
)
def test_consistent_configurations(kwargs: dict[str, Any], derived: dict[str, Any]) -> None:
    plan = derive_batch_plan(**kwargs)

    assert {name: getattr(plan, name) for name in derived} == derived


def test_role_dp_sizes_are_filled_in() -> None:
    rule = derive_batch_plan(**config(role_dp_sizes={"ref": 4}))
    model = derive_batch_plan(**config(role_dp_sizes={"reward": 1}))

    assert dict(rule.role_dp_sizes) == {"actor_rollout": 2, "actor_logprob": 2, "actor_update": 2, "ref": 4}
    assert dict(model.role_dp_sizes)["reward"] == 1
    assert model.dispatch_size("reward") == 32
    assert rule.dispatch_size("adv") == 32
    with pytest.raises(KeyError, match="unknown role 'critic'"):
        rule.dispatch_size("critic")
    with pytest.raises(TypeError):
        rule.role_dp_sizes["ref"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.dp_size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            config(global_batch_size=0), "global_batch_size must be a positive integer, got 0", id="zero-global"
        ),
        pytest.param(
            config(micro_batch_size=-1), "micro_batch_size must be a positive integer, got -1", id="negative-micro"
        ),
        pytest.param(
            config(rollout_micro_batch_size=0),
            "rollout_micro_batch_size must be a positive integer, got 0",
            id="zero-rollout-micro",
        ),
        pytest.param(
            config(num_generations=2.5), "num_generations must be a positive integer, got 2.5", id="float-generations"
        ),
        pytest.param(config(dp_size=True), "dp_size must be a positive integer, got True", id="bool-dp"),
        pytest.param(
            config(role_dp_sizes={"critic": 2}),
            "role_dp_sizes has an unknown role 'critic'; known roles: actor_rollout, actor_logprob, actor_update, ref, reward",
            id="unknown-role",
        ),
        pytest.param(
            config(role_dp_sizes={"ref": 0}),
            "role_dp_sizes['ref'] must be a positive integer, got 0",
            id="zero-role-dp",
        ),
        pytest.param(
            config(role_dp_sizes={"actor_update": 4}),
            "role_dp_sizes['actor_update']=4 disagrees with dp_size=2; dp_size is the actor update's DP size: drop the entry or make them equal",
            id="update-dp-disagrees",
        ),
        pytest.param(
            config(mini_batch_size=16),
            "mini_batch_size=16 is larger than global_batch_size=8: an update cannot use more prompts than an iteration has; lower mini_batch_size or raise global_batch_size",
            id="mini-above-global",
        ),
        pytest.param(
            config(global_batch_size=12, mini_batch_size=8),
            "global_batch_size=12 is not a multiple of mini_batch_size=8, so the iteration would end on a partial update; make mini_batch_size a divisor of 12 or global_batch_size a multiple of 8",
            id="global-not-multiple-of-mini",
        ),
        pytest.param(
            config(global_batch_size=6, mini_batch_size=3, num_generations=2, dp_size=4, micro_batch_size=1),
            "mini_batch_size × num_generations = 3 × 2 = 6 pairs per update do not split evenly over dp_size=4 ranks; make dp_size a divisor of 6 or change mini_batch_size",
            id="update-not-split-over-dp",
        ),
        pytest.param(
            config(micro_batch_size=3),
            "each rank's 8 pairs per update (mini_batch_size × num_generations / dp_size = 4 × 4 / 2) are not a multiple of micro_batch_size=3, so gradient accumulation would end on a partial micro-batch; make micro_batch_size a divisor of 8",
            id="micro-not-dividing-rank-batch",
        ),
        pytest.param(
            config(global_batch_size=6, mini_batch_size=6, micro_batch_size=2, role_dp_sizes={"ref": 5}),
            "global_batch_size × num_generations = 6 × 4 = 24 pairs do not split evenly over ref's 5 DP ranks (role_dp_sizes['ref']=5); set role_dp_sizes['ref'] to a divisor of 24",
            id="role-dp-not-dividing",
        ),
        pytest.param(
            config(global_batch_size=2, mini_batch_size=2, dp_size=4, micro_batch_size=2),
            "actor_rollout would get 2 pairs per DP rank (8 pairs over dp_size=4, actor_rollout's default), not a multiple of num_generations=4, which splits a prompt's group across ranks; set role_dp_sizes['actor_rollout'] to a divisor of global_batch_size=2",
            id="rollout-splits-groups",
        ),
        pytest.param(
            config(global_batch_size=6, mini_batch_size=6, micro_batch_size=2, role_dp_sizes={"reward": 4}),
            "reward would get 6 pairs per DP rank (24 pairs over role_dp_sizes['reward']=4), not a multiple of num_generations=4, which splits a prompt's group across ranks; set role_dp_sizes['reward'] to a divisor of global_batch_size=6",
            id="reward-model-splits-groups",
        ),
        pytest.param(
            config(ref_micro_batch_size=5),
            "ref_micro_batch_size=5 does not divide ref's dispatch of 16 pairs per DP rank; set ref_micro_batch_size to a divisor of 16",
            id="ref-micro-not-dividing",
        ),
        pytest.param(
            config(rollout_micro_batch_size=32),
            "rollout_micro_batch_size=32 does not divide actor_rollout's dispatch of 16 pairs per DP rank; set rollout_micro_batch_size to a divisor of 16",
            id="rollout-micro-too-large",
        ),
        pytest.param(
            config(mini_batch_size=8, micro_batch_size=8, role_dp_sizes={"actor_logprob": 8}),
            "old_micro_batch_size=8 (defaulted to micro_batch_size) does not divide actor_logprob's dispatch of 4 pairs per DP rank; set old_micro_batch_size to a divisor of 4",
            id="defaulted-old-micro",
        ),
    ],
)
def test_inconsistent_configurations(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        derive_batch_plan(**kwargs)
    assert str(caught.value) == message


def test_describe() -> None:
    plan = derive_batch_plan(**config(rollout_micro_batch_size=8, role_dp_sizes={"ref": 4}))

    assert plan.describe().splitlines() == [
        "num_generations               4",
        "global_batch_size             8 prompts = 32 pairs per iteration",
        "mini_batch_size               4 prompts = 16 pairs per update = 8 per rank × dp_size 2",
        "updates_per_iteration         2 (off-policy)",
        "micro_batch_size              4 pairs per forward+backward",
        "gradient_accumulation_steps   2 = 16 / (4 × 2)",
        "dispatch per DP rank (pairs per iteration):",
        "  actor_rollout               16 = 32 / dp 2",
        "  actor_logprob               16 = 32 / dp 2",
        "  actor_update                16 = 32 / dp 2",
        "  ref                         8 = 32 / dp 4",
        "  reward                      32 (rule reward: the whole batch)",
        "  adv                         32 (the whole batch)",
        "service batch                 8 pairs = lcm(rollout 8, ref 4, old 4); service_target_prompts 2 (× 4 = 8 pairs)",
    ]


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 8),
    dp=st.integers(1, 8),
    micro=st.integers(1, 8),
    steps=st.integers(1, 4),
    updates=st.integers(1, 4),
    forward=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
)
def test_derived_numbers_satisfy_their_identities(
    n: int, dp: int, micro: int, steps: int, updates: int, forward: tuple[int, int, int]
) -> None:
    # Build a consistent configuration backwards from the derived numbers, then check the plan recovers them.
    assume(micro * dp * steps % n == 0)
    mini = micro * dp * steps // n
    global_batch = mini * updates
    assume(global_batch % dp == 0)  # whole groups per rollout rank
    plan = derive_batch_plan(
        global_batch_size=global_batch,
        mini_batch_size=mini,
        num_generations=n,
        dp_size=dp,
        micro_batch_size=micro,
        # Each forward micro divides the per-rank dispatch by construction: a divisor of micro × steps × updates.
        rollout_micro_batch_size=math.gcd(micro * steps * updates, forward[0] * micro),
        ref_micro_batch_size=math.gcd(micro * steps * updates, forward[1]),
        old_micro_batch_size=math.gcd(micro * steps * updates, forward[2] * 2),
    )

    assert isinstance(plan, BatchPlan)
    assert plan.gradient_accumulation_steps == steps
    assert plan.updates_per_iteration == updates
    assert plan.gradient_accumulation_steps * plan.micro_batch_size * plan.dp_size == plan.mini_batch_size * n
    for role in ROLES:
        dp_role = plan.role_dp_sizes.get(role)
        if dp_role is not None:
            assert plan.dispatch_size(role) * dp_role == plan.pairs_per_iteration
    assert plan.reward_dispatch_size == plan.adv_dispatch_size == plan.pairs_per_iteration
    micros = (plan.rollout_micro_batch_size, plan.ref_micro_batch_size, plan.old_micro_batch_size)
    assert all(plan.service_batch_size % size == 0 for size in micros)
    assert all(any(candidate % size for size in micros) for candidate in range(1, plan.service_batch_size))
    target = plan.service_target_prompts
    assert target * n % plan.service_batch_size == 0
    assert all(k * n % plan.service_batch_size for k in range(1, target))


@settings(max_examples=100, deadline=None)
@given(
    global_batch=st.integers(1, 16),
    mini=st.integers(1, 16),
    n=st.integers(1, 8),
    dp=st.integers(1, 8),
    micro=st.integers(1, 16),
)
def test_a_plan_exists_exactly_when_the_divisibility_rules_hold(
    global_batch: int, mini: int, n: int, dp: int, micro: int
) -> None:
    consistent = (
        mini <= global_batch
        and global_batch % mini == 0
        and (mini * n) % (micro * dp) == 0
        and global_batch % dp == 0  # the rollout dispatch keeps whole groups
    )
    kwargs: dict[str, Any] = {
        "global_batch_size": global_batch,
        "mini_batch_size": mini,
        "num_generations": n,
        "dp_size": dp,
        "micro_batch_size": micro,
    }
    if consistent:
        assert derive_batch_plan(**kwargs).gradient_accumulation_steps == mini * n // (micro * dp)
    else:
        with pytest.raises(ValueError):
            derive_batch_plan(**kwargs)
