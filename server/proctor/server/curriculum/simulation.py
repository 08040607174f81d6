"""A simulated learner trained on a curriculum through the server's own machinery: what ``proctor preview
--simulate`` and the curriculum benchmark (``python -m bench curriculum_sim``) run.

**The learner.** Record ``i`` has a latent difficulty ``d_i`` (in logits) and the learner a skill ``s`` per
source; a completion of record ``i`` passes (reward 1) with probability ``σ(s_source − d_i)``, else fails
(reward 0). Each prompt gets ``G`` completions, drawn from a seeded generator. Nothing carries over between
sources: a source's skill grows from its own groups only.

**A per-record learner** (``record_share`` ρ > 0): record ``i`` also has a logit of its own, ``r_i``, and
passes with probability ``σ(s_source + r_i − d_i)``. Of each group's step, the source's skill takes ``1 − ρ``
and the group's own record ``ρ · step_size · mean_j |A_j|``: a record is learned partly on its own, so choosing
which records come back can pay. It is measured on the sources' own records (``trained_pass_rate``), since a
held-out record has no logit of its own.

**The update** is one GRPO step on that learner: advantages ``A_j = (r_j − mean) / (std + 1e-4)`` within each
group (the population std), the loss ``mean over the batch's completions of A_j · log π(y_j)``. Its gradient
with respect to a source's skill is exactly ``(1 / 2B) · Σ_groups mean_j |A_j|`` over that source's groups
of the batch (``B`` prompts): for rewards in {0, 1}, ``Σ_j A_j · ∂log π(y_j)/∂s = Σ_j A_j · r_j`` (the
advantages sum to zero) ``= G · m(1 − m) / (std + ε) = (G / 2) · mean_j |A_j|``, ``m`` being the group's
pass rate. So a skill grows only from groups whose rewards differ, in proportion to the |advantage| mass
they carry, and the step is the same for every sampler::

    s_source += step_size / (2 · B) · Σ_{groups g of the source} mean_j |A_gj|

**Constants, chosen once before any comparison.** Skills start at 0. Latent difficulties span
[``LATENT_EASIEST``, ``LATENT_HARDEST``] = [−1, 6] logits: at skill 0 the easiest records pass 73% of the
time and the hardest 0.25% (a group of 8 then scores alike 98% of the time: the hard end of a real dataset,
which a fresh model cannot learn from yet). Where a source has one difficulty for all its records, they spread
±``SOURCE_SPREAD`` = ±1 logit around it: records of one source differ, less than the rungs of a ladder do.
``step_size`` η = 1: a batch of groups that all pass half the time
moves its source's logit by ½ per step, so no single step jumps across more than a fraction of the range;
the step size sets the time scale alone and is the same for every sampler.

**The driver** (:func:`simulate`) runs the real objects: a :class:`~proctor.server.store.Store` in memory, a
:class:`~proctor.server.curriculum.progress.CurriculumProgress` built as the server builds it for an empty
state file, a :class:`~proctor.server.curriculum.mixing.Mixer`, the iterations recorded as the server records
them (so the records served are marked as on the server), the grades stored, folded and counted by the store
and the progress. The grades of iteration ``k`` are folded in only after iteration ``k + lag`` has been drawn:
``lag = 1`` is a real client, which fetches step ``k + 1`` while step ``k`` is graded. The learner itself
trains on every batch at once, whatever the server has folded in.

**Refill.** A stage with a ``refill`` rule has its step's groups replaced as a trainer's ``POST /refill`` replaces
them (:mod:`proctor.server.curriculum.refill`): round 1 takes every group of the batch the rule does not keep
and puts in its place a record of the same source, drawn by :func:`~proctor.server.curriculum.refill.replacement_key`
(not one of the source's records the step already holds), which the learner attempts like any other; round
``r + 1`` looks only at the positions replaced in round ``r``, up to the rule's ``max_rounds``. The ``k``-th
replacement of an iteration is graded in slot ``batch_size + k``. Every group generated counts in the rollouts
and its grades go to the store and the progress with the iteration's others (the replaced groups' included);
the learner trains on the final occupant of each position only.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from proctor.server.curriculum.adaptive import item_tracking
from proctor.server.curriculum.loader import Curriculum
from proctor.server.curriculum.mixing import Mixer
from proctor.server.curriculum.permutation import derive_key
from proctor.server.curriculum.progress import CurriculumProgress
from proctor.server.curriculum.refill import GroupGrades, keeps, replacement_key
from proctor.server.spec import LearnabilityParams, RefillSpec, TargetDifficultyParams
from proctor.server.state.rows import GradeRow, IterationRow, TransitionRecord
from proctor.server.store import Store

__all__ = [
    "ADVANTAGE_EPS",
    "HELD_OUT",
    "LATENT_EASIEST",
    "LATENT_HARDEST",
    "SOURCE_SPREAD",
    "Learner",
    "LearnerModel",
    "Population",
    "ServedRecord",
    "SimulationResult",
    "StageRun",
    "StepRecord",
    "advantage_mass",
    "population_from_curriculum",
    "simulate",
    "source_range",
]

FloatArray = npt.NDArray[np.float64]

LATENT_EASIEST = -1.0
LATENT_HARDEST = 6.0
# Half the width of one source's range of latent difficulties, when a source has one difficulty for all its
# records: records of one source differ, but less than the sources of a ladder do.
SOURCE_SPREAD = 1.0
HELD_OUT = 500
ADVANTAGE_EPS = 1e-4


@dataclass(frozen=True, slots=True)
class LearnerModel:
    """The learner's constants (see the module docstring for why these values). ``record_share`` is the part of
    each group's step that its own record learns (the per-record learner); 0 is the per-source learner."""

    group_size: int = 8
    step_size: float = 1.0
    initial_skill: float = 0.0
    record_share: float = 0.0


def source_range(position: float) -> tuple[float, float]:
    """The latent difficulties of a source at ``position`` on [0, 1] of a ladder (0 the easiest): a range of
    width ``2 · SOURCE_SPREAD`` inside [LATENT_EASIEST, LATENT_HARDEST]."""
    lo = LATENT_EASIEST + position * (LATENT_HARDEST - LATENT_EASIEST - 2 * SOURCE_SPREAD)
    return lo, lo + 2 * SOURCE_SPREAD


class Population:
    """Every record's latent difficulty and a held-out draw from the same distributions, never served.

    ``tables`` holds the difficulties of finite sources by record key; ``ranges`` the uniform range a source's
    records are drawn from when there is no table (an endless source): record ``k``'s difficulty is then a
    function of the seed, the source and ``k``. ``origin`` says, per source, where the difficulties came from.
    """

    def __init__(
        self,
        tables: Mapping[str, FloatArray],
        ranges: Mapping[str, tuple[float, float]],
        held_out: Mapping[str, FloatArray],
        origin: Mapping[str, str],
        seed: int,
    ) -> None:
        self.tables = dict(tables)
        self.ranges = dict(ranges)
        self.held_out = dict(held_out)
        self.origin = dict(origin)
        self.seed = seed

    def difficulties(self, source: str, keys: Sequence[int]) -> FloatArray:
        table = self.tables.get(source)
        if table is not None:
            return table[np.asarray(keys, dtype=np.int64)]
        lo, hi = self.ranges[source]
        u = np.array([derive_key(self.seed, "latent", source, k) / 2.0**64 for k in keys], dtype=np.float64)
        result: FloatArray = lo + (hi - lo) * u
        return result


def population_from_curriculum(curriculum: Curriculum, seed: int, held_out: int = HELD_OUT) -> Population:
    """Latent difficulties for a curriculum's own records, for every source a stage serves:

    - a finite source whose records carry a difficulty (``difficulty_field``): those numbers, scaled together
      over all such sources onto [LATENT_EASIEST, LATENT_HARDEST];
    - else a source with a difficulty (``difficulty``, or one its knobs give): uniform over
      :func:`source_range` at the source's place among those sources (scaled together onto [0, 1]);
    - else uniform over the whole range, from ``seed``.

    The held-out draw splits ``held_out`` records evenly over the sources: fresh draws from a source's range,
    or, for record difficulties, a seeded resample of the source's own.
    """
    names = list(dict.fromkeys(source for stage in curriculum.stages for source, _ in stage.mix))
    rng = np.random.default_rng(derive_key(seed, "population"))
    per_record: dict[str, FloatArray] = {}
    per_source: dict[str, float] = {}
    for name in names:
        src = curriculum.sources[name]
        if (values := src.record_difficulties()) is not None:
            per_record[name] = values
        elif (value := src.source_difficulty()) is not None:
            per_source[name] = value
    tables: dict[str, FloatArray] = {}
    ranges: dict[str, tuple[float, float]] = {}
    origin: dict[str, str] = {}
    if per_record:
        lo = min(float(v.min()) for v in per_record.values())
        hi = max(float(v.max()) for v in per_record.values())
        for name, raw in per_record.items():
            scaled = np.full_like(raw, 0.5) if hi == lo else (raw - lo) / (hi - lo)
            tables[name] = LATENT_EASIEST + (LATENT_HARDEST - LATENT_EASIEST) * scaled
            spec_field = getattr(curriculum.spec.sources[name], "difficulty_field", None)
            origin[name] = (
                f"each record's {spec_field!r} field, scaled onto [{LATENT_EASIEST:g}, {LATENT_HARDEST:g}] logits"
            )
    if per_source:
        lo, hi = min(per_source.values()), max(per_source.values())
        for name, value in per_source.items():
            ranges[name] = source_range(0.5 if hi == lo else (value - lo) / (hi - lo))
            lo_r, hi_r = ranges[name]
            origin[name] = f"the source's difficulty ({value:.2f}): uniform over [{lo_r:.2f}, {hi_r:.2f}] logits"
    for name in names:
        if name not in tables and name not in ranges:
            ranges[name] = (LATENT_EASIEST, LATENT_HARDEST)
            origin[name] = f"no difficulty known: drawn uniformly from [{LATENT_EASIEST:g}, {LATENT_HARDEST:g}] logits"
    held: dict[str, FloatArray] = {}
    for i, name in enumerate(names):
        count = held_out // len(names) + (1 if i < held_out % len(names) else 0)
        if name in tables:
            held[name] = rng.choice(tables[name], size=count)
        else:
            lo_r, hi_r = ranges[name]
            held[name] = rng.uniform(lo_r, hi_r, size=count)
    # Finite sources without a table get one, drawn once: a table costs a look-up where a hash costs microseconds.
    for name in names:
        size = curriculum.sources[name].size
        if name not in tables and size is not None:
            lo_r, hi_r = ranges.pop(name)
            tables[name] = np.random.default_rng(derive_key(seed, "latent", name)).uniform(lo_r, hi_r, size=size)
    return Population(tables, ranges, held, origin, seed)


def advantage_mass(rewards: FloatArray) -> FloatArray:
    """Per group (a row of ``rewards``): the mean |advantage| of its completions under GRPO's normalisation;
    zero for a group whose rewards are all equal."""
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    mass: FloatArray = (np.abs(rewards - mean) / (std + ADVANTAGE_EPS)).mean(axis=1)
    return mass


class Learner:
    """The simulated policy: one skill per source and, with a ``record_share``, one per record; trained by
    :meth:`learn` (see the module docstring)."""

    def __init__(self, population: Population, model: LearnerModel, seed: int) -> None:
        if not 0.0 <= model.record_share < 1.0:
            raise ValueError(f"record_share must be in [0, 1), got {model.record_share}")
        self.population = population
        self.model = model
        self.skill: dict[str, float] = {}
        # A record's own skill, for the records of finite sources (an endless source's records never come back).
        self.record_skill = {source: np.zeros(len(table)) for source, table in population.tables.items()}
        self._rng = np.random.default_rng(derive_key(seed, "learner"))

    def skill_of(self, source: str) -> float:
        return self.skill.get(source, self.model.initial_skill)

    def pass_probability(self, picks: Sequence[tuple[str, int]]) -> FloatArray:
        by_source: dict[str, list[int]] = {}
        for n, (source, _) in enumerate(picks):
            by_source.setdefault(source, []).append(n)
        out = np.empty(len(picks), dtype=np.float64)
        for source, slots in by_source.items():
            keys = [picks[n][1] for n in slots]
            logit = self.skill_of(source) - self.population.difficulties(source, keys)
            if source in self.record_skill:
                logit = logit + self.record_skill[source][np.asarray(keys, dtype=np.int64)]
            out[slots] = _sigmoid(logit)
        return out

    def attempt(self, picks: Sequence[tuple[str, int]]) -> FloatArray:
        """Rewards, one row of ``group_size`` completions per pick."""
        p = self.pass_probability(picks)
        draws = self._rng.random((len(picks), self.model.group_size))
        rewards: FloatArray = (draws < p[:, None]).astype(np.float64)
        return rewards

    def learn(self, picks: Sequence[tuple[str, int]], rewards: FloatArray) -> None:
        """One GRPO step on the batch: the source's skill takes ``1 − record_share`` of each group's step, and the
        group's own record learns ``record_share`` of ``step_size · mean |A|`` (it is one of the batch's groups,
        but the record's logit is its own)."""
        mass = advantage_mass(rewards)
        share = self.model.record_share
        scale = (1.0 - share) * self.model.step_size / (2 * len(picks))
        for (source, key), m in zip(picks, mass, strict=True):
            if m > 0:
                self.skill[source] = self.skill_of(source) + scale * float(m)
                if share > 0 and source in self.record_skill:
                    self.record_skill[source][key] += share * self.model.step_size * float(m)

    def held_out_pass_rate(self) -> float:
        """The expected pass rate over the held-out records, each counted once."""
        total, count = 0.0, 0
        for source, d in self.population.held_out.items():
            total += float(_sigmoid(self.skill_of(source) - d).sum())
            count += len(d)
        return total / count if count else 0.0

    def trained_pass_rate(self) -> float:
        """The expected pass rate over the finite sources' own records, each counted once: what a per-record
        learner is measured by (held-out records have no skill of their own)."""
        total, count = 0.0, 0
        for source, d in self.population.tables.items():
            total += float(_sigmoid(self.skill_of(source) - d + self.record_skill[source]).sum())
            count += len(d)
        return total / count if count else 0.0


def _sigmoid(x: FloatArray | float) -> FloatArray:
    result: FloatArray = 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))
    return result


@dataclass(frozen=True, slots=True)
class StepRecord:
    iteration: int
    stage: int
    held_out: float  # after the learner's step on this iteration's batch
    # Share of the groups this iteration drew (before any refill) whose completions all scored alike.
    zero_variance: float
    rollouts: int = 0  # completions generated up to and including this iteration, replacement groups included
    trained: float = 0.0  # the pass rate over the sources' own records, after the step
    # Share of the batch the learner trained on (each position's final occupant) that scored alike; without
    # refill, the same as ``zero_variance``.
    trained_zero_variance: float = 0.0
    refill_rounds: int = 0  # refill rounds that replaced at least one group
    replacements: int = 0  # replacement groups generated, over all rounds
    zero_variance_replacements: int = 0  # of those, the ones that scored alike themselves


@dataclass(frozen=True, slots=True)
class ServedRecord:
    sample_id: str
    served: int
    pass_rate: float | None  # the server's posterior mean p̂ when the stage ended; None for an endless source


@dataclass(slots=True)
class StageRun:
    """One stretch of iterations served by one stage."""

    stage: int
    name: str
    sampler: str
    first: int
    stop: int
    held_out_start: float
    held_out_end: float
    groups: int = 0  # groups drawn (replacements not counted)
    zero_variance_groups: int = 0  # of those, the ones that scored alike
    replacements: int = 0  # replacement groups generated by the stage's refill rule
    zero_variance_replacements: int = 0  # of those, the ones that scored alike
    top: list[ServedRecord] = field(default_factory=list)
    # A learning_progress stage's source weights at its first and its last iteration; None for a fixed mix.
    mix_first: dict[str, float] | None = None
    mix_last: dict[str, float] | None = None

    @property
    def zero_variance_share(self) -> float:
        return self.zero_variance_groups / self.groups if self.groups else 0.0


@dataclass(frozen=True, slots=True)
class SimulationResult:
    initial_held_out: float
    steps: list[StepRecord]
    stages: list[StageRun]
    transitions: list[TransitionRecord]
    skills: dict[str, float]

    def steps_to(self, target: float, *, trained: bool = False) -> int | None:
        """Iterations run until the held-out pass rate (or, ``trained``, the pass rate over the sources' own
        records) first reached ``target``; None if it never did."""
        for n, step in enumerate(self.steps):
            if (step.trained if trained else step.held_out) >= target:
                return n + 1
        return None

    def rollouts_to(self, target: float, *, trained: bool = False) -> int | None:
        """Completions generated until the pass rate :meth:`steps_to` reads first reached ``target``."""
        steps = self.steps_to(target, trained=trained)
        return None if steps is None else self.steps[steps - 1].rollouts

    @property
    def zero_variance_share(self) -> float:
        """Mean over steps of the share of the groups drawn that scored alike (before any refill)."""
        return float(np.mean([s.zero_variance for s in self.steps])) if self.steps else 0.0

    @property
    def trained_zero_variance_share(self) -> float:
        """Mean over steps of the share of the batch trained on (after refill) that scored alike."""
        return float(np.mean([s.trained_zero_variance for s in self.steps])) if self.steps else 0.0

    @property
    def replacements(self) -> int:
        """Replacement groups generated over the run."""
        return sum(s.replacements for s in self.steps)


def _fresh_progress(curriculum: Curriculum, store: Store) -> CurriculumProgress:
    """The progress of a new run, wired as the server wires it for an empty state file."""
    store.bind(curriculum=curriculum.name, curriculum_hash=curriculum.hash, seed=curriculum.seed)
    store.track_items(item_tracking(curriculum))
    return CurriculumProgress.start(curriculum)


def simulate(
    curriculum: Curriculum,
    population: Population,
    *,
    steps: int,
    batch_size: int = 32,
    model: LearnerModel | None = None,
    lag: int = 1,
    seed: int = 0,
    stop_at: float | None = None,
    stop_on_trained: bool = False,
    top: int = 5,
) -> SimulationResult:
    """Train a :class:`Learner` on ``curriculum`` for ``steps`` iterations (fewer when the held-out pass rate,
    or with ``stop_on_trained`` the pass rate over the sources' own records, reaches ``stop_at``), the server's
    statistics ``lag`` iterations behind (see the module docstring)."""
    if lag < 0:
        raise ValueError(f"lag must be 0 or more iterations, got {lag}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be 1 prompt or more, got {batch_size}")
    model = model or LearnerModel()
    if model.group_size < 2:
        raise ValueError(f"a GRPO group needs 2 completions or more, got group_size {model.group_size}")
    learner = Learner(population, model, seed)
    store = Store(":memory:")
    try:
        progress = _fresh_progress(curriculum, store)
        mixer = Mixer(curriculum)
        pending: deque[tuple[int, list[GradeRow]]] = deque()
        initial = held_out = learner.held_out_pass_rate()
        rollouts = 0
        records: list[StepRecord] = []
        runs: list[StageRun] = []
        served: Counter[tuple[str, int]] = Counter()  # by the stage being run
        for iteration in range(steps):
            draw = progress.draw(iteration, batch_size, mixer)
            for _ in draw.steps():
                pass
            picks = draw.picks
            sample_ids = [curriculum.sources[source].sample_id(key) for source, key in picks]
            row = IterationRow(
                iteration, batch_size, draw.stage, [{"sample_id": s} for s in sample_ids], decision=draw.decision
            )
            store.record_iterations([(row, draw.transitions, None)])
            if not runs or runs[-1].stage != draw.stage:
                if runs:
                    _close(runs[-1], served, progress, curriculum, top)
                    served.clear()
                spec = curriculum.spec.stages[draw.stage]
                runs.append(
                    StageRun(draw.stage, spec.name, spec.sampler.kind, iteration, iteration, held_out, held_out)
                )
            run = runs[-1]
            if draw.decision is not None and "mix" in draw.decision.detail:
                run.mix_last = draw.decision.detail["mix"]["weights"]
                run.mix_first = run.mix_first or run.mix_last

            rewards = learner.attempt(picks)
            alike = int(_alike(rewards).sum())
            rollouts += rewards.size
            grades = _grade_rows(iteration, draw.stage, picks, sample_ids, rewards)
            served.update(picks)
            refill = curriculum.stages[draw.stage].refill
            rounds = replacements = alike_replacements = 0
            if refill is None:
                final_picks, final_rewards = picks, rewards
            else:
                final_picks, final_rewards = list(picks), rewards.copy()
                for new_picks, new_rewards in _refill(
                    refill, curriculum, learner, iteration, final_picks, final_rewards
                ):
                    new_ids = [curriculum.sources[source].sample_id(key) for source, key in new_picks]
                    slots = range(batch_size + replacements, batch_size + replacements + len(new_picks))
                    grades += _grade_rows(iteration, draw.stage, new_picks, new_ids, new_rewards, slots)
                    rounds += 1
                    replacements += len(new_picks)
                    alike_replacements += int(_alike(new_rewards).sum())
                    rollouts += new_rewards.size
                    served.update(new_picks)
            learner.learn(final_picks, final_rewards)
            held_out, trained = learner.held_out_pass_rate(), learner.trained_pass_rate()
            trained_alike = alike if refill is None else int(_alike(final_rewards).sum())
            records.append(
                StepRecord(
                    iteration,
                    draw.stage,
                    held_out,
                    alike / len(picks),
                    rollouts,
                    trained,
                    trained_alike / len(final_picks),
                    rounds,
                    replacements,
                    alike_replacements,
                )
            )
            run.stop, run.held_out_end = iteration + 1, held_out
            run.groups += len(picks)
            run.zero_variance_groups += alike
            run.replacements += replacements
            run.zero_variance_replacements += alike_replacements

            pending.append((iteration, grades))
            while pending and pending[0][0] <= iteration - lag:
                rows = pending.popleft()[1]
                progress.graded(rows, store.insert_grades(rows))
            if stop_at is not None and (trained if stop_on_trained else held_out) >= stop_at:
                break
        if runs:
            _close(runs[-1], served, progress, curriculum, top)
        return SimulationResult(
            initial, records, runs, list(progress.schedule.transitions), {s: learner.skill_of(s) for s in learner.skill}
        )
    finally:
        store.close()


def _alike(rewards: FloatArray) -> npt.NDArray[np.bool_]:
    """Per group (a row of ``rewards``): whether its completions all scored alike."""
    alike: npt.NDArray[np.bool_] = rewards.min(axis=1) == rewards.max(axis=1)
    return alike


def _refill(
    rule: RefillSpec,
    curriculum: Curriculum,
    learner: Learner,
    iteration: int,
    picks: list[tuple[str, int]],
    rewards: FloatArray,
) -> Iterator[tuple[list[tuple[str, int]], FloatArray]]:
    """The refill rounds of one step, as the server's ``POST /refill`` runs them: each round replaces, in
    position order, the groups of ``positions`` (every position in round 1, then those replaced in the round
    before) that ``rule`` does not keep, with records of the same source the step does not hold yet. Updates
    ``picks`` and ``rewards`` in place to each position's latest occupant, and yields each round's replacements
    and their rewards (rounds that replace nothing are not run)."""
    held: dict[str, set[int]] = {}
    for source, key in picks:
        held.setdefault(source, set()).add(key)
    positions = list(range(len(picks)))
    for round_ in range(1, rule.max_rounds + 1):
        positions = [p for p in positions if not keeps(rule, GroupGrades.of(rewards[p].tolist()))]
        if not positions:
            return
        new_picks: list[tuple[str, int]] = []
        for position in positions:
            source = picks[position][0]
            size = curriculum.sources[source].size
            key = replacement_key(curriculum.seed, source, size, iteration, round_, position, held[source])
            held[source].add(key)
            new_picks.append((source, key))
        new_rewards = learner.attempt(new_picks)
        for position, pick, row in zip(positions, new_picks, new_rewards, strict=True):
            picks[position] = pick
            rewards[position] = row
        yield new_picks, new_rewards


def _grade_rows(
    iteration: int,
    stage: int,
    picks: Sequence[tuple[str, int]],
    sample_ids: Sequence[str],
    rewards: FloatArray,
    slots: Iterable[int] | None = None,
) -> list[GradeRow]:
    """The grade rows of ``picks``' groups, in ``slots`` (by default the batch's own: 0, 1, ...)."""
    return [
        GradeRow((iteration, sid, slot, j, f"{slot}-{j}"), stage, source, float(r), {}, None)
        for slot, (source, _), sid, group in zip(
            range(len(picks)) if slots is None else slots, picks, sample_ids, rewards.tolist(), strict=True
        )
        for j, r in enumerate(group)
    ]


def _close(
    run: StageRun, served: Counter[tuple[str, int]], progress: CurriculumProgress, curriculum: Curriculum, top: int
) -> None:
    """The stage's most served records, with the server's p̂ of each as the stage ends."""
    params = curriculum.spec.stages[run.stage].sampler.params
    prior = params.prior if isinstance(params, LearnabilityParams | TargetDifficultyParams) else (1.0, 1.0)
    items = progress.adaptive.items
    for (source, key), count in served.most_common(top):
        p = None
        if items.tracks(source):
            p = float(items.pass_rate(source, prior, np.array([key], dtype=np.int64))[0])
        run.top.append(ServedRecord(curriculum.sources[source].sample_id(key), count, p))
