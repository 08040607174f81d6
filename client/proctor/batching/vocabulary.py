"""The batch-size vocabulary of GRPO training, derived from a few numbers instead of set by hand.

Units matter, and the names say which (as in MindSpeed-RL's data system):

- ``global_batch_size`` and ``mini_batch_size`` count **prompts**: one iteration's prompts, one actor update's
  prompts. ``mini == global`` is on-policy, ``mini < global`` off-policy (several updates per iteration).
- every micro-batch size counts **(prompt, response) pairs**, i.e. already × ``num_generations``:
  ``micro_batch_size`` per actor forward+backward on one rank, and the rollout / ref logps / old logps forward
  micro-batches (each defaults to ``micro_batch_size``: what fits a training step fits a forward pass).
- a role's *dispatch size* is the pairs one of its DP ranks reads per iteration:
  ``global × n / role_dp_size``; a rule reward reads the whole batch (``global × n``), a reward model its
  share, and the advantage always the whole batch.

Derived rather than configured (tunix's "derive accumulation steps from mini and micro batch"):

- ``updates_per_iteration = global / mini``;
- ``gradient_accumulation_steps = mini × n / (micro × dp)``;
- the *service batch* ``lcm(rollout, ref, old micro)`` pairs, which cuts evenly into every forward micro-batch,
  and ``service_target_prompts``, the fewest prompts whose ``n`` completions fill a multiple of it.

Every combination that does not divide evenly is a ``ValueError`` that names the numbers and the one to change.

TRL's ``GRPOTrainer`` counts the same quantities in rows per device instead (``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``steps_per_generation``), and lets a micro-batch hold part of a prompt's group;
:func:`derive_generation_sizes` is this vocabulary in those units, and ``ProctorGRPOConfig`` derives its sizes
through it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from proctor.batching.lcm import lcm

__all__ = ["GROUP_ROLES", "ROLES", "BatchPlan", "GenerationSizes", "derive_batch_plan", "derive_generation_sizes"]

ROLES: tuple[str, ...] = ("actor_rollout", "actor_logprob", "actor_update", "ref", "reward")
"""The roles that read from the data system, each with a DP size (``role_dp_sizes``)."""

GROUP_ROLES: frozenset[str] = frozenset({"actor_rollout", "reward"})
"""Roles that must hold a prompt's whole group on one rank: rollout generates a prompt's ``n`` completions
together, and a GRPO reward dispatch must be a multiple of ``n`` (MindSpeed-RL's rule for ``reward_dispatch_size``).
"""


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Every batch size of one GRPO configuration; made by :func:`derive_batch_plan`, which checks them."""

    global_batch_size: int
    """Prompts per iteration."""
    mini_batch_size: int
    """Prompts per actor update."""
    num_generations: int
    """Completions per prompt (``n_samples_per_prompt``)."""
    dp_size: int
    """Data-parallel ranks of the actor update."""
    micro_batch_size: int
    """Pairs per actor forward+backward on one rank."""
    rollout_micro_batch_size: int
    """Pairs per rollout (generation) call."""
    ref_micro_batch_size: int
    """Pairs per reference-model logps forward."""
    old_micro_batch_size: int
    """Pairs per old-policy logps forward."""
    pairs_per_iteration: int
    """``global_batch_size × num_generations``."""
    pairs_per_update: int
    """``mini_batch_size × num_generations``."""
    pairs_per_update_per_rank: int
    """``pairs_per_update / dp_size``."""
    updates_per_iteration: int
    """``global_batch_size / mini_batch_size``."""
    gradient_accumulation_steps: int
    """``pairs_per_update_per_rank / micro_batch_size``."""
    actor_rollout_dispatch_size: int
    actor_logprob_dispatch_size: int
    actor_update_dispatch_size: int
    ref_dispatch_size: int
    reward_dispatch_size: int
    """Per reward DP rank for a reward model; the whole batch for a rule reward."""
    adv_dispatch_size: int
    """Always the whole batch: advantages are normalised over each group."""
    reward_is_model: bool
    """Whether ``role_dp_sizes`` gave the reward a DP size (a reward model) or not (a rule reward)."""
    service_batch_size: int
    """``lcm(rollout, ref, old micro)`` pairs: cuts evenly into each of those micro-batches."""
    service_target_prompts: int
    """Fewest prompts whose ``num_generations`` completions are a multiple of ``service_batch_size``."""
    role_dp_sizes: Mapping[str, int] = field(compare=False)
    """Each role's DP size, defaults filled in (no ``reward`` entry for a rule reward)."""

    @property
    def on_policy(self) -> bool:
        """One update per iteration (``mini_batch_size == global_batch_size``)."""
        return self.mini_batch_size == self.global_batch_size

    def dispatch_size(self, role: str) -> int:
        """The pairs one DP rank of ``role`` reads per iteration (``adv`` included)."""
        sizes = {
            "actor_rollout": self.actor_rollout_dispatch_size,
            "actor_logprob": self.actor_logprob_dispatch_size,
            "actor_update": self.actor_update_dispatch_size,
            "ref": self.ref_dispatch_size,
            "reward": self.reward_dispatch_size,
            "adv": self.adv_dispatch_size,
        }
        if role not in sizes:
            raise KeyError(f"unknown role {role!r}; known roles: {', '.join(sizes)}")
        return sizes[role]

    def describe(self) -> str:
        """The derived table, one line per number, with the arithmetic behind it."""
        n = self.num_generations
        policy = "on-policy" if self.on_policy else "off-policy"
        lines = [
            f"num_generations               {n}",
            f"global_batch_size             {self.global_batch_size} prompts = {self.pairs_per_iteration} pairs"
            " per iteration",
            f"mini_batch_size               {self.mini_batch_size} prompts = {self.pairs_per_update} pairs per"
            f" update = {self.pairs_per_update_per_rank} per rank × dp_size {self.dp_size}",
            f"updates_per_iteration         {self.updates_per_iteration} ({policy})",
            f"micro_batch_size              {self.micro_batch_size} pairs per forward+backward",
            f"gradient_accumulation_steps   {self.gradient_accumulation_steps}"
            f" = {self.pairs_per_update} / ({self.micro_batch_size} × {self.dp_size})",
            "dispatch per DP rank (pairs per iteration):",
        ]
        for role in ROLES:
            if role == "reward" and not self.reward_is_model:
                lines.append(f"  {role:<27} {self.reward_dispatch_size} (rule reward: the whole batch)")
            else:
                dp = self.role_dp_sizes[role]
                lines.append(
                    f"  {role:<27} {self.dispatch_size(role)} = {self.pairs_per_iteration} / dp {dp}"
                    + (" (reward model)" if role == "reward" else "")
                )
        lines.append(f"  adv                         {self.adv_dispatch_size} (the whole batch)")
        lines.append(
            f"service batch                 {self.service_batch_size} pairs = lcm(rollout"
            f" {self.rollout_micro_batch_size}, ref {self.ref_micro_batch_size}, old {self.old_micro_batch_size})"
            f"; service_target_prompts {self.service_target_prompts} (× {n} = {self.service_target_prompts * n} pairs)"
        )
        return "\n".join(lines)


def _positive(name: str, value: object) -> int:
    # bool is an int subclass, and True is never meant as a batch size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def derive_batch_plan(
    *,
    global_batch_size: int,
    mini_batch_size: int,
    num_generations: int,
    dp_size: int,
    micro_batch_size: int,
    rollout_micro_batch_size: int | None = None,
    ref_micro_batch_size: int | None = None,
    old_micro_batch_size: int | None = None,
    role_dp_sizes: Mapping[str, int] | None = None,
) -> BatchPlan:
    """Derive and check every batch size from the few that are chosen.

    ``global_batch_size`` and ``mini_batch_size`` count prompts; the micro sizes count (prompt, response)
    pairs. ``dp_size`` is the actor update's DP size and the default of every role in ``role_dp_sizes``
    (:data:`ROLES`); give ``role_dp_sizes["reward"]`` for a reward model, leave it out for a rule reward.
    The rollout / ref / old micro sizes default to ``micro_batch_size``.

    Raises ``ValueError`` naming the numbers and what to change, for: a size that is not a positive integer,
    an unknown role, ``role_dp_sizes["actor_update"] != dp_size``, ``mini > global``, ``global % mini``,
    ``(mini·n) % dp``, ``(mini·n/dp) % micro``, ``(global·n) % role_dp``, a group role's dispatch that is not
    a multiple of ``n``, and a rollout / old / ref micro size that does not divide its role's dispatch.
    """
    g = _positive("global_batch_size", global_batch_size)
    mini = _positive("mini_batch_size", mini_batch_size)
    n = _positive("num_generations", num_generations)
    dp = _positive("dp_size", dp_size)
    micro = _positive("micro_batch_size", micro_batch_size)
    # (name, value, whether it was defaulted): a defaulted size gets that said in its error message.
    forward_micros = {
        role: (name, micro if value is None else _positive(name, value), value is None)
        for role, name, value in (
            ("actor_rollout", "rollout_micro_batch_size", rollout_micro_batch_size),
            ("actor_logprob", "old_micro_batch_size", old_micro_batch_size),
            ("ref", "ref_micro_batch_size", ref_micro_batch_size),
        )
    }
    given_dp = dict(role_dp_sizes or {})
    for role, value in given_dp.items():
        if role not in ROLES:
            raise ValueError(f"role_dp_sizes has an unknown role {role!r}; known roles: {', '.join(ROLES)}")
        _positive(f"role_dp_sizes[{role!r}]", value)
    if given_dp.get("actor_update", dp) != dp:
        raise ValueError(
            f"role_dp_sizes['actor_update']={given_dp['actor_update']} disagrees with dp_size={dp}; "
            "dp_size is the actor update's DP size: drop the entry or make them equal"
        )

    if mini > g:
        raise ValueError(
            f"mini_batch_size={mini} is larger than global_batch_size={g}: an update cannot use more prompts than "
            "an iteration has; lower mini_batch_size or raise global_batch_size"
        )
    if g % mini:
        raise ValueError(
            f"global_batch_size={g} is not a multiple of mini_batch_size={mini}, so the iteration would end on a "
            f"partial update; make mini_batch_size a divisor of {g} or global_batch_size a multiple of {mini}"
        )
    pairs_per_update = mini * n
    if pairs_per_update % dp:
        raise ValueError(
            f"mini_batch_size × num_generations = {mini} × {n} = {pairs_per_update} pairs per update do not split "
            f"evenly over dp_size={dp} ranks; make dp_size a divisor of {pairs_per_update} or change mini_batch_size"
        )
    per_rank = pairs_per_update // dp
    if per_rank % micro:
        raise ValueError(
            f"each rank's {per_rank} pairs per update (mini_batch_size × num_generations / dp_size = {mini} × {n} "
            f"/ {dp}) are not a multiple of micro_batch_size={micro}, so gradient accumulation would end on a "
            f"partial micro-batch; make micro_batch_size a divisor of {per_rank}"
        )

    pairs = g * n
    resolved_dp = {role: given_dp.get(role, dp) for role in ROLES if role != "reward" or role in given_dp}
    dispatch: dict[str, int] = {}
    for role, role_dp in resolved_dp.items():
        source = f"role_dp_sizes[{role!r}]={role_dp}" if role in given_dp else f"dp_size={role_dp}, {role}'s default"
        if pairs % role_dp:
            raise ValueError(
                f"global_batch_size × num_generations = {g} × {n} = {pairs} pairs do not split evenly over {role}'s "
                f"{role_dp} DP ranks ({source}); set role_dp_sizes[{role!r}] to a divisor of {pairs}"
            )
        dispatch[role] = pairs // role_dp
        if role in GROUP_ROLES and dispatch[role] % n:
            raise ValueError(
                f"{role} would get {dispatch[role]} pairs per DP rank ({pairs} pairs over {source}), not a multiple of "
                f"num_generations={n}, which splits a prompt's group across ranks; set role_dp_sizes[{role!r}] "
                f"to a divisor of global_batch_size={g}"
            )
    for role, (name, size, defaulted) in forward_micros.items():
        if dispatch[role] % size:
            shown = f"{name}={size}" + (" (defaulted to micro_batch_size)" if defaulted else "")
            raise ValueError(
                f"{shown} does not divide {role}'s dispatch of {dispatch[role]} pairs per DP rank; "
                f"set {name} to a divisor of {dispatch[role]}"
            )

    rollout_micro = forward_micros["actor_rollout"][1]
    ref_micro = forward_micros["ref"][1]
    old_micro = forward_micros["actor_logprob"][1]
    service = _service_batch(rollout_micro, ref_micro, old_micro)
    return BatchPlan(
        global_batch_size=g,
        mini_batch_size=mini,
        num_generations=n,
        dp_size=dp,
        micro_batch_size=micro,
        rollout_micro_batch_size=rollout_micro,
        ref_micro_batch_size=ref_micro,
        old_micro_batch_size=old_micro,
        pairs_per_iteration=pairs,
        pairs_per_update=pairs_per_update,
        pairs_per_update_per_rank=per_rank,
        updates_per_iteration=g // mini,
        gradient_accumulation_steps=per_rank // micro,
        actor_rollout_dispatch_size=dispatch["actor_rollout"],
        actor_logprob_dispatch_size=dispatch["actor_logprob"],
        actor_update_dispatch_size=dispatch["actor_update"],
        ref_dispatch_size=dispatch["ref"],
        reward_dispatch_size=dispatch.get("reward", pairs),
        adv_dispatch_size=pairs,
        reward_is_model="reward" in given_dp,
        service_batch_size=service,
        # k prompts give k·n pairs; the fewest with service | k·n is service / gcd(service, n).
        service_target_prompts=service // math.gcd(service, n),
        role_dp_sizes=MappingProxyType(resolved_dp),
    )


def _service_batch(*sizes: int | None) -> int:
    """The batch that cuts evenly into every given forward micro-batch size: their ``lcm`` (1 when none is set)."""
    given = [size for size in sizes if size is not None]
    return lcm(*given) if given else 1


@dataclass(frozen=True, slots=True)
class GenerationSizes:
    """Every size of one ``GRPOTrainer``-style configuration, in rows ((prompt, completion) pairs) per device.

    Made by :func:`derive_generation_sizes`, which checks them.
    """

    per_device_train_batch_size: int
    """Rows per training forward+backward micro-step on one device."""
    gradient_accumulation_steps: int
    steps_per_generation: int
    """Micro-steps one generation feeds; the local generation batch is ``per_device × steps_per_generation`` rows."""
    steps_per_generation_derived: bool
    """Whether ``steps_per_generation`` was derived here (left unset) rather than given."""
    num_generations: int
    dp_size: int
    rollout_micro_batch_size: int | None
    ref_logps_micro_batch_size: int | None
    old_logps_micro_batch_size: int | None
    service_batch_size: int
    """``lcm`` of the forward micro sizes that are set: the local generation batch is a multiple of it."""

    @property
    def local_generation_rows(self) -> int:
        """Rows one device generates per generation: TRL's buffer, cut into each pass's micro-batches."""
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def generation_batch_size(self) -> int:
        """Rows generated per generation over all devices."""
        return self.local_generation_rows * self.dp_size

    @property
    def rows_per_update(self) -> int:
        """Rows behind one optimizer step over all devices."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.dp_size

    def describe(self) -> str:
        """One line of the derived sizes, for a training script's start-up output."""
        micros = ", ".join(
            f"{name} {size}"
            for name, size in (
                ("rollout", self.rollout_micro_batch_size),
                ("ref", self.ref_logps_micro_batch_size),
                ("old", self.old_logps_micro_batch_size),
            )
            if size is not None
        )
        derived = " (derived)" if self.steps_per_generation_derived else ""
        return (
            f"{self.per_device_train_batch_size} rows per micro-step × {self.gradient_accumulation_steps} accumulated"
            f" × {self.dp_size} devices = {self.rows_per_update} rows per update; steps_per_generation"
            f" {self.steps_per_generation}{derived}: {self.local_generation_rows} rows generated per device"
            + (f", service batch {self.service_batch_size} = lcm({micros})" if micros else "")
        )


def derive_generation_sizes(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_generations: int,
    dp_size: int,
    steps_per_generation: int | None = None,
    rollout_micro_batch_size: int | None = None,
    ref_logps_micro_batch_size: int | None = None,
    old_logps_micro_batch_size: int | None = None,
) -> GenerationSizes:
    """Check a ``GRPOTrainer``-style configuration and derive ``steps_per_generation`` when it is left unset.

    The local generation batch (``per_device_train_batch_size × steps_per_generation`` rows) must be a multiple
    of the service batch, ``lcm`` of the forward micro sizes that are set, so that generation and the old/ref
    log-prob passes each cut it into whole micro-batches. Left unset, ``steps_per_generation`` becomes the
    smallest multiple of ``gradient_accumulation_steps`` that makes it so: generations stay aligned with
    optimizer steps. Given, a mismatch is a ``ValueError`` naming the numbers and what to change.
    """
    per_device = _positive("per_device_train_batch_size", per_device_train_batch_size)
    accumulation = _positive("gradient_accumulation_steps", gradient_accumulation_steps)
    n = _positive("num_generations", num_generations)
    dp = _positive("dp_size", dp_size)
    micros = {
        name: None if value is None else _positive(name, value)
        for name, value in (
            ("rollout_micro_batch_size", rollout_micro_batch_size),
            ("ref_logps_micro_batch_size", ref_logps_micro_batch_size),
            ("old_logps_micro_batch_size", old_logps_micro_batch_size),
        )
    }
    service = _service_batch(*micros.values())
    derived = steps_per_generation is None
    if steps_per_generation is None:
        per_step = per_device * accumulation
        steps = accumulation * (service // math.gcd(service, per_step))
    else:
        steps = _positive("steps_per_generation", steps_per_generation)
        local = per_device * steps
        if local % service:
            named = ", ".join(f"{name.split('_')[0]} {size}" for name, size in micros.items() if size is not None)
            raise ValueError(
                f"the local generation batch, per_device_train_batch_size ({per_device}) × steps_per_generation "
                f"({steps}) = {local} rows, is not a multiple of the service batch lcm({named}) = {service}: set "
                f"steps_per_generation to a multiple of {service // math.gcd(service, per_device)}, leave it unset "
                "to have it derived, or change the micro-batch sizes"
            )
    if (per_device * steps * dp) % n:
        raise ValueError(
            f"the generation batch, per_device_train_batch_size ({per_device}) × steps_per_generation ({steps}) × "
            f"{dp} devices = {per_device * steps * dp} rows, is not a multiple of num_generations={n}, so a "
            "prompt's group would be cut: change per_device_train_batch_size or steps_per_generation"
        )
    return GenerationSizes(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps,
        steps_per_generation_derived=derived,
        num_generations=n,
        dp_size=dp,
        rollout_micro_batch_size=micros["rollout_micro_batch_size"],
        ref_logps_micro_batch_size=micros["ref_logps_micro_batch_size"],
        old_logps_micro_batch_size=micros["old_logps_micro_batch_size"],
        service_batch_size=service,
    )
