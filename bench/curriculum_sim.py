"""The curricula against a simulated learner, and ``/sample``'s latency with each adaptive sampler on.

**Learning** (:mod:`proctor.server.curriculum.simulation`, the server's own store, progress, samplers and
mixes): 2,000 records over 5 JSONL sources, the latent difficulty of source ``k``'s records uniform over
``source_range(k / 4)`` (a ladder from [−1, 1] to [4, 6] logits), written as each record's ``difficulty``
field; a held-out draw of 500 more (100 per source) that is never served. 32 prompts per step, 8 completions
per prompt, the statistics one step behind (a real client's prefetch). Per seed, every curriculum sees the
same records, the same held-out draw and the same learner seed:

- ``uniform``: one stage over the 5 sources, equal weights, seeded epochs;
- ``staged gates``: the ladder: stage ``k`` serves source ``k`` (with 10% replay of the earlier ones) and
  advances once the stage's mean reward over its last 256 graded completions reaches 0.8, after 5 steps at
  least (capped at an even share of the steps); uniform inside each stage;
- ``learning_progress``: one stage like ``uniform`` whose source weights are set by learning progress (its
  default parameters); and the same with ``skip_zero_variance`` choosing the records;
- ``learning_progress + refill``: ``learning_progress`` with ``refill: {kind: zero_variance}`` (up to 4 rounds):
  each step's groups whose completions all scored alike are replaced by records of the same source drawn
  uniformly, as a trainer's ``POST /refill`` would have them (see :mod:`proctor.server.curriculum.simulation`);
  and ``refill``, the same rule on ``uniform``, to show refill on its own;
- ``learnability``, ``skip_zero_variance``, ``target_difficulty`` (``pass_rate``, and ``record``, which reads
  each record's latent difficulty exactly: an oracle's ranking): one stage like ``uniform``, with the sampler's
  default parameters.

A last row is no curriculum: an oracle that fills each source's quota of the ``uniform`` curriculum with the
records whose true pass rate is nearest ½ at that step, what choosing records inside a source could do at
best (roughly) under this learner and this mix; it is not a candidate for "best sampler".

Two learners, each over every curriculum:

- **per source** (the simulation's learner): a record passes with probability σ(skill_source − d); measured on
  the held-out records;
- **per record**: half of each group's step stays with its own record (``record_share`` 0.5): σ(skill_source +
  skill_record − d); measured on the sources' own 2,000 records, since a held-out record has no skill of its
  own.

Measured: steps and rollouts (completions generated, the replacement groups' included) until the pass rate
reaches 80% (a run stops there); the share of the groups each step drew, before any refill, whose completions
all scored alike (zero variance: no GRPO signal), the "served" column; and the same share of the batches the
learner trained on, after refill (the "trained" column: the same as "served" without refill), each a mean over
steps and seeds.
Then the best per-record sampler at lag 0, 1 and 2, on the per-source learner.

**Latency**: real ``proctor serve`` processes (state in a SQLite file, one grader process each), one per
sampler, on a curriculum whose one source has 10^6 records (arithmetic, ``size: 1000000``): new iterations of
batch 32 one after another, each followed by ``/grade`` of 8 completions per prompt (each record right with
its own fixed probability, so pass rates, streaks and weights really move); p50/p99 of ``/sample`` after a
warm-up. The servers take turns iteration by iteration, so that whatever else the machine does meanwhile
falls on every sampler alike.

Usage::

    python -m bench curriculum_sim                 # 5 seeds, ≤ 600 steps a run, 300 timed iterations (minutes)
    python -m bench curriculum_sim --quick         # 1 seed, ≤ 60 steps, 30 timed iterations of 10^5 records
    python -m bench curriculum_sim --seeds 5 --steps 800 --skip-latency
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench._http import Connection
from bench._results import save
from proctor.cli.launcher import ServerProcess
from proctor.server.curriculum.adaptive import AdaptiveSampling, finite_sizes
from proctor.server.curriculum.loader import Curriculum, load_curriculum
from proctor.server.curriculum.mixing import Mixer
from proctor.server.curriculum.permutation import derive_key
from proctor.server.curriculum.samplers import SamplerState, StageFeedback
from proctor.server.curriculum.simulation import Learner, LearnerModel, Population, simulate, source_range
from proctor.server.sources.base import Source
from proctor.server.state.items import ItemState, ItemStatistics

__all__ = ["LEARNERS", "VARIANTS", "main", "run"]

SOURCES, RECORDS, HELD_OUT = 5, 2_000, 500
BATCH, GROUP, TARGET = 32, 8, 0.8
LAG = 1
GATE = "{threshold: 0.8, window: 256, min_steps: 5}"
LATENCY_SAMPLERS = (
    ("uniform", "{kind: uniform}"),
    ("learnability", "{kind: learnability}"),
    ("skip_zero_variance", "{kind: skip_zero_variance}"),
    ("target_difficulty (pass_rate)", "{kind: target_difficulty, params: {difficulty: pass_rate}}"),
    # A static difficulty, as `record` has (one file of 10^6 records with a difficulty field would do as well).
    ("target_difficulty (source)", "{kind: target_difficulty, params: {difficulty: source}}"),
)
# Goals the run is reported against: learning_progress's steps (per-source learner), the best per-record
# sampler's steps (per-record learner), each against uniform's; /sample's p99 with each adaptive sampler.
LEARNING_PROGRESS_GOAL, PER_RECORD_GOAL, P99_TARGET_MS = 0.6, 0.8, 10.0
# learning_progress + refill (per-source learner): rollouts to the target ÷ uniform's, and the share of the
# groups trained on that scored alike.
REFILL_ROLLOUTS_GOAL, REFILL_ZERO_VARIANCE_GOAL = 0.7, 0.05
LEARNING_PROGRESS = "{kind: learning_progress}"
REFILL = "{kind: zero_variance}"


@dataclass(frozen=True)
class Variant:
    name: str
    sampler: str | None  # the one stage's sampler; None for the staged ladder
    per_record: bool = True  # a per-record sampler: a candidate for "best sampler"
    mixing: str | None = None  # the one stage's mixing, when not fixed
    refill: str | None = None  # the one stage's refill rule, if any


@dataclass(frozen=True)
class LearnerKind:
    name: str
    record_share: float
    trained: bool  # measured on the sources' own records rather than the held-out ones


ORACLE = "oracle: true p nearest ½ in each source (not a sampler)"
VARIANTS = (
    Variant("uniform", "{kind: uniform}", per_record=False),
    Variant("staged gates", None, per_record=False),
    Variant("learning_progress", "{kind: uniform}", per_record=False, mixing=LEARNING_PROGRESS),
    Variant(
        "learning_progress + skip_zero_variance",
        "{kind: skip_zero_variance}",
        per_record=False,
        mixing=LEARNING_PROGRESS,
    ),
    Variant("learning_progress + refill", "{kind: uniform}", per_record=False, mixing=LEARNING_PROGRESS, refill=REFILL),
    Variant("refill", "{kind: uniform}", per_record=False, refill=REFILL),
    Variant("learnability", "{kind: learnability}"),
    Variant("skip_zero_variance", "{kind: skip_zero_variance}"),
    Variant("target_difficulty (pass_rate)", "{kind: target_difficulty, params: {difficulty: pass_rate}}"),
    Variant("target_difficulty (record)", "{kind: target_difficulty, params: {difficulty: record}}"),
)
LEARNERS = (
    LearnerKind("per source", 0.0, trained=False),
    LearnerKind("per record", 0.5, trained=True),
)


# --- learning ---------------------------------------------------------------------------------------------


def write_population(folder: Path, seed: int) -> Population:
    """The records of one seed, as JSONL files in ``folder``, and their latent difficulties."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(derive_key(seed, "bench-population"))
    tables: dict[str, npt.NDArray[np.float64]] = {}
    held: dict[str, npt.NDArray[np.float64]] = {}
    origin: dict[str, str] = {}
    for k in range(SOURCES):
        lo, hi = source_range(k / (SOURCES - 1))
        # Rounded as written, so that the file's difficulty and the learner's are the same number.
        values = rng.uniform(lo, hi, RECORDS // SOURCES).round(3)
        held[f"level{k}"] = rng.uniform(lo, hi, HELD_OUT // SOURCES)
        tables[f"level{k}"] = values
        origin[f"level{k}"] = f"uniform over [{lo:g}, {hi:g}]"
        lines = (
            json.dumps({"prompt": f"level {k} problem {i}", "answer": "0", "difficulty": float(d)})
            for i, d in enumerate(values)
        )
        (folder / f"level{k}.jsonl").write_text("\n".join(lines) + "\n")
    return Population(tables, {}, held, origin, seed)


def curriculum_yaml(variant: Variant, steps: int, seed: int) -> str:
    sources = "".join(
        f"  level{k}: {{path: level{k}.jsonl, difficulty_field: difficulty, graders: [numeric]}}\n"
        for k in range(SOURCES)
    )
    if variant.sampler is not None:
        mix = ", ".join(f"{{source: level{k}}}" for k in range(SOURCES))
        mixing = "" if variant.mixing is None else f", mixing: {variant.mixing}"
        refill = "" if variant.refill is None else f", refill: {variant.refill}"
        stages = f"  - {{name: all, until_step: {steps}, mix: [{mix}], sampler: {variant.sampler}{mixing}{refill}}}\n"
    else:
        stages = ""
        for k in range(SOURCES):
            until = max(k + 1, (k + 1) * steps // SOURCES)
            extra = (", replay: 0.1" if k else "") + (f", advance: {GATE}" if k < SOURCES - 1 else "")
            stages += f"  - {{name: level{k}, until_step: {until}, mix: [{{source: level{k}}}]{extra}}}\n"
    return f"name: sim\nseed: {seed}\nsources:\n{sources}stages:\n{stages}"


def _load(folder: Path, variant: Variant, steps: int, seed: int) -> Curriculum:
    path = folder / f"{variant.name.replace(' ', '_').replace('(', '').replace(')', '').replace('+', 'and')}.yaml"
    path.write_text(curriculum_yaml(variant, steps, seed))
    return load_curriculum(path)


def run_variant(
    folder: Path,
    population: Population,
    variant: Variant,
    seed: int,
    steps: int,
    lag: int,
    learner: LearnerKind = LEARNERS[0],
) -> dict[str, Any]:
    curriculum = _load(folder, variant, steps, seed)
    started = time.perf_counter()
    result = simulate(
        curriculum,
        population,
        steps=steps,
        batch_size=BATCH,
        model=LearnerModel(group_size=GROUP, record_share=learner.record_share),
        lag=lag,
        seed=seed,
        stop_at=TARGET,
        stop_on_trained=learner.trained,
    )
    return {
        "variant": variant.name,
        "learner": learner.name,
        "seed": seed,
        "lag": lag,
        "steps_to_target": result.steps_to(TARGET, trained=learner.trained),
        "rollouts_to_target": result.rollouts_to(TARGET, trained=learner.trained),
        "steps_run": len(result.steps),
        "zero_variance_share": result.zero_variance_share,
        "trained_zero_variance_share": result.trained_zero_variance_share,
        "replacements": result.replacements,
        "zero_variance_replacements": sum(s.zero_variance_replacements for s in result.steps),
        "refill_rounds": sum(s.refill_rounds for s in result.steps),
        "transitions": [t.reason for t in result.transitions],
        "wall_s": time.perf_counter() - started,
    }


def run_oracle(
    folder: Path, population: Population, seed: int, steps: int, learner_kind: LearnerKind = LEARNERS[0]
) -> dict[str, Any]:
    """Not a sampler of the server: each source's quota (the uniform curriculum's, from its mixer) filled with
    the records whose true pass rate is nearest ½ right now. What choosing records inside a source could do at
    best, roughly, under this learner and this mix."""
    mixer = Mixer(_load(folder, VARIANTS[0], steps, seed))
    learner = Learner(population, LearnerModel(group_size=GROUP, record_share=learner_kind.record_share), seed)
    shares: list[float] = []
    reached = None
    for iteration in range(steps):
        picks: list[tuple[str, int]] = []
        for source, count in mixer.quotas(0, BATCH, iteration):
            p = learner.pass_probability([(source, k) for k in range(len(population.tables[source]))])
            picks += [(source, int(k)) for k in np.argsort(np.abs(p - 0.5), kind="stable")[:count]]
        rewards = learner.attempt(picks)
        learner.learn(picks, rewards)
        shares.append(float((rewards.min(axis=1) == rewards.max(axis=1)).mean()))
        rate = learner.trained_pass_rate() if learner_kind.trained else learner.held_out_pass_rate()
        if rate >= TARGET:
            reached = iteration + 1
            break
    return {
        "variant": ORACLE,
        "learner": learner_kind.name,
        "seed": seed,
        "lag": 0,
        "steps_to_target": reached,
        "rollouts_to_target": None if reached is None else reached * BATCH * GROUP,
        "steps_run": len(shares),
        "zero_variance_share": float(np.mean(shares)),
        "trained_zero_variance_share": float(np.mean(shares)),
        "replacements": 0,
        "zero_variance_replacements": 0,
        "refill_rounds": 0,
        "transitions": [],
        "wall_s": 0.0,
    }


@dataclass(frozen=True)
class Summary:
    name: str
    steps: list[int | None]  # per seed; None: not reached
    rollouts: list[int | None]
    zero_variance: float  # mean over seeds, of the groups drawn (before any refill)
    trained_zero_variance: float  # mean over seeds, of the batches trained on (after refill)

    @property
    def median(self) -> float:
        return statistics.median(_or_inf(s) for s in self.steps)

    @property
    def median_rollouts(self) -> float:
        return statistics.median(_or_inf(s) for s in self.rollouts)


def _or_inf(steps: int | None) -> float:
    return float("inf") if steps is None else float(steps)


def summarise(runs: Sequence[dict[str, Any]], names: Sequence[str | int], key: str = "variant") -> list[Summary]:
    out = []
    for name in names:
        mine = [r for r in runs if r[key] == name]
        out.append(
            Summary(
                str(name),
                [r["steps_to_target"] for r in mine],
                [r.get("rollouts_to_target") for r in mine],
                float(np.mean([r["zero_variance_share"] for r in mine])),
                float(np.mean([r["trained_zero_variance_share"] for r in mine])),
            )
        )
    return out


def _steps_cell(s: Summary, steps: int) -> str:
    reached = [x for x in s.steps if x is not None]
    if s.median == float("inf"):
        return f"not reached in {steps} ({len(reached)}/{len(s.steps)} seeds reached)"
    spread = f"{min(_or_inf(x) for x in s.steps):.0f}–" + (
        f"{max(reached)}" if len(reached) == len(s.steps) else f">{steps}"
    )
    return f"{s.median:.0f} ({spread})"


def _ratio(value: float, base: float) -> float | None:
    """``value / base``; None when uniform's number is no base (0, or a target it never reached)."""
    return None if base in (0.0, float("inf")) else value / base


def _times(ratio: float | None) -> str:
    return "-" if ratio is None or ratio == float("inf") else f"{ratio:.2f}×"


def learning_table(summaries: Sequence[Summary], steps: int, learner: str = "per source") -> str:
    base = summaries[0]
    lines = [
        f"| curriculum ({learner} learner) | steps to {TARGET:.0%} (median, min–max) | rollouts to {TARGET:.0%} "
        "(median) | zero-variance share served | zero-variance share trained | steps ÷ uniform | rollouts ÷ uniform "
        "| zero-variance ÷ uniform |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        rollouts = "-" if s.median_rollouts == float("inf") else f"{s.median_rollouts:,.0f}"
        lines.append(
            f"| {s.name} | {_steps_cell(s, steps)} | {rollouts} | {s.zero_variance:.1%} "
            f"| {s.trained_zero_variance:.1%} | {_times(_ratio(s.median, base.median))} "
            f"| {_times(_ratio(s.median_rollouts, base.median_rollouts))} "
            f"| {_times(_ratio(s.zero_variance, base.zero_variance))} |"
        )
    return "\n".join(lines)


def lag_table(summaries: Sequence[Summary], steps: int, sampler: str) -> str:
    lines = [
        f"| {sampler}: statistics lag | steps to {TARGET:.0%} (median, min–max) | zero-variance share |",
        "| --- | ---: | ---: |",
    ]
    for s in summaries:
        lines.append(f"| {s.name} | {_steps_cell(s, steps)} | {s.zero_variance:.1%} |")
    return "\n".join(lines)


def learning(seeds: int, steps: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    lags: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="proctor-curriculum-sim-") as tmp:
        populations: dict[int, tuple[Path, Population]] = {}
        for seed in range(seeds):
            folder = Path(tmp, f"seed{seed}")
            populations[seed] = (folder, write_population(folder, seed))
            for learner in LEARNERS:
                for variant in VARIANTS:
                    runs.append(run_variant(folder, populations[seed][1], variant, seed, steps, LAG, learner))
                runs.append(run_oracle(folder, populations[seed][1], seed, steps, learner))
        best: dict[str, str] = {}
        for learner in LEARNERS:
            mine = [r for r in runs if r["learner"] == learner.name]
            summaries = summarise(mine, [v.name for v in VARIANTS])
            candidates = [s for s, v in zip(summaries, VARIANTS, strict=True) if v.per_record]
            best[learner.name] = min(candidates, key=lambda s: (s.median, s.zero_variance)).name
        [variant] = [v for v in VARIANTS if v.name == best[LEARNERS[0].name]]
        for lag in (0, 1, 2):
            for seed in range(seeds):
                if lag == LAG:
                    lags.extend(
                        r
                        for r in runs
                        if r["variant"] == variant.name and r["seed"] == seed and r["learner"] == LEARNERS[0].name
                    )
                else:
                    folder, population = populations[seed]
                    lags.append(run_variant(folder, population, variant, seed, steps, lag))
    return {"runs": runs, "lags": lags, "best": best}


# --- latency ----------------------------------------------------------------------------------------------


def latency_curriculum(sampler: str, records: int) -> str:
    return (
        "name: latency\nseed: 5\n"
        "sources:\n"
        f"  arith: {{kind: arithmetic, ops: ['+', '-'], digits: [1, 3], size: {records}, graders: [numeric]}}\n"
        f"stages:\n  - {{name: only, until_step: 100000000, mix: [{{source: arith}}], sampler: {sampler}}}\n"
    )


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass
class _Server:
    """One sampler's server as the load sees it: its connection, its records' answers, its latencies."""

    name: str
    conn: Connection
    source: Source
    sample_ms: list[float] = field(default_factory=list)
    grade_ms: list[float] = field(default_factory=list)

    async def step(self, iteration: int, timed: bool) -> None:
        """``/sample`` of a new iteration, then ``/grade`` of 8 completions per prompt."""
        started = time.perf_counter()
        batch = await self.conn.json("POST", "/sample", {"iteration": iteration, "batch_size": BATCH})
        took = (time.perf_counter() - started) * 1000
        items = []
        for sample in batch["samples"]:
            key = int(sample["sample_id"].rsplit(":", 1)[1])
            answer = int(str(self.source.record(key).answer))
            # Each record is right with its own fixed probability: some always, some never, most between.
            p_right = derive_key("right", key) / 2.0**64
            for j in range(GROUP):
                right = derive_key("draw", iteration, sample["slot"], j) / 2.0**64 < p_right
                completion = str(answer if right else answer + 1)
                items.append(
                    {
                        "sample_id": sample["sample_id"],
                        "slot": sample["slot"],
                        "completion_index": j,
                        "completion": completion,
                    }
                )
        started = time.perf_counter()
        await self.conn.json("POST", "/grade", {"iteration": iteration, "items": items})
        if timed:
            self.sample_ms.append(took)
            self.grade_ms.append((time.perf_counter() - started) * 1000)


async def _drive(servers: Sequence[tuple[str, int, Source]], iterations: int, warm_up: int) -> list[_Server]:
    """Every server through the same iterations, taking turns iteration by iteration: whatever else the
    machine does meanwhile falls on all of them alike."""
    loads = [_Server(name, await Connection.open("127.0.0.1", port), source) for name, port, source in servers]
    try:
        for iteration in range(warm_up + iterations):
            for load in loads:
                await load.step(iteration, timed=iteration >= warm_up)
    finally:
        for load in loads:
            await load.conn.close()
    return loads


def latency(iterations: int, warm_up: int, records: int) -> list[dict[str, Any]]:
    """One server per sampler, all up at once and driven in turns (see :func:`_drive`)."""
    with tempfile.TemporaryDirectory(prefix="proctor-curriculum-latency-") as tmp, contextlib.ExitStack() as stack:
        servers: list[tuple[str, int, Source]] = []
        for n, (name, sampler) in enumerate(LATENCY_SAMPLERS):
            path = Path(tmp, f"{n}.yaml")
            path.write_text(latency_curriculum(sampler, records))
            args = [
                str(path),
                "--database-url",
                str(Path(tmp, f"{n}.db")),
                "--grader-workers",
                "1",
                "--log-level",
                "warning",
            ]
            server = stack.enter_context(ServerProcess(args, log=Path(tmp, f"{n}.log")))
            servers.append((name, server.port, load_curriculum(path).sources["arith"]))
        loads = asyncio.run(_drive(servers, iterations, warm_up))
    return [
        {
            "sampler": load.name,
            "iterations": len(load.sample_ms),
            "sample_p50_ms": _percentile(load.sample_ms, 0.5),
            "sample_p99_ms": _percentile(load.sample_ms, 0.99),
            "sample_max_ms": max(load.sample_ms),
            "grade_p50_ms": _percentile(load.grade_ms, 0.5),
        }
        for load in loads
    ]


def latency_table(rows: Sequence[dict[str, Any]], records: int) -> str:
    lines = [
        f"| sampler ({records:,} records, batch {BATCH}) | /sample p50 ms | /sample p99 ms | /sample max ms "
        f"| /grade ({BATCH}×{GROUP}) p50 ms | p99 ≤ {P99_TARGET_MS:g} ms |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        met = "met" if r["sample_p99_ms"] <= P99_TARGET_MS else "missed"
        lines.append(
            f"| {r['sampler']} | {r['sample_p50_ms']:.1f} | {r['sample_p99_ms']:.1f} | {r['sample_max_ms']:.1f} "
            f"| {r['grade_p50_ms']:.1f} | {met} |"
        )
    return "\n".join(lines)


# --- cost per draw ------------------------------------------------------------------------------------------

DRAW_SIZES = (10_000, 100_000, 1_000_000)


def draw_costs(sizes: Sequence[int], iterations: int) -> list[dict[str, Any]]:
    """Each adaptive sampler in this process, no server: batches of 32 from one source of ``n`` records, 10,000
    of them graded, the target held still. The first batch builds the sampler's structures (a sum tree over
    every record, for the weighted samplers); the later ones are the per-draw cost."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="proctor-draw-cost-") as tmp:
        for name, sampler in LATENCY_SAMPLERS[1:]:
            for n in sizes:
                path = Path(tmp, "c.yaml")
                path.write_text(latency_curriculum(sampler, n))
                curriculum = load_curriculum(path)
                items = ItemStatistics(finite_sizes(curriculum))
                rng = np.random.default_rng(derive_key("draw-cost", n) % 2**32)
                for key in rng.choice(n, min(n, 10_000), replace=False).tolist():
                    items.set("arith", key, ItemState(float(key % 5), float(key % 3), 1, key % 2))
                adaptive = AdaptiveSampling(curriculum, items, SamplerState())
                still = StageFeedback(None, 0)
                timings: list[float] = []
                for iteration in range(iterations + 1):
                    record = adaptive.sampler(0)
                    assert record is not None
                    started = time.perf_counter()
                    _, parts = adaptive.draw(record, iteration, [("arith", BATCH)], still)
                    for _ in parts:
                        pass
                    timings.append(time.perf_counter() - started)
                steady = [t / BATCH * 1e6 for t in timings[1:]]
                rows.append(
                    {
                        "sampler": name,
                        "records": n,
                        "first_ms": timings[0] * 1000,
                        "per_record_us_p50": _percentile(steady, 0.5),
                        "per_record_us_p99": _percentile(steady, 0.99),
                    }
                )
    return rows


def draw_cost_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"| sampler (batch {BATCH}) | records | first batch ms (builds) | per record µs, p50 | per record µs, p99 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['sampler']} | {r['records']:,} | {r['first_ms']:.1f} | {r['per_record_us_p50']:.1f} "
            f"| {r['per_record_us_p99']:.1f} |"
        )
    return "\n".join(lines)


# --- the run ----------------------------------------------------------------------------------------------


def run(
    seeds: int, steps: int, latency_iterations: int, warm_up: int, records: int, skip_latency: bool = False
) -> dict[str, Any]:
    started = time.perf_counter()
    out: dict[str, Any] = {
        "env": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "seeds": seeds,
        "steps": steps,
        "learning": learning(seeds, steps),
    }
    out["learning_s"] = time.perf_counter() - started
    if not skip_latency:
        out["draw_costs"] = draw_costs(DRAW_SIZES if records >= DRAW_SIZES[-1] else (records // 10, records), 200)
        out["latency"] = latency(latency_iterations, warm_up, records)
        out["latency_records"] = records
    return out


def _verdict(ratio: float | None, goal: float, steps: int) -> str:
    if ratio is None:
        return f"not measurable (uniform did not reach {TARGET:.0%} in {steps} steps)"
    if ratio == float("inf"):
        return f"missed (it did not reach {TARGET:.0%} in {steps} steps)"
    return f"{'met' if ratio <= goal else 'missed'} ({ratio:.2f}×)"


def report(out: dict[str, Any]) -> str:
    steps, seeds = out["steps"], out["seeds"]
    learn = out["learning"]
    lines = [
        f"Simulated learners: {RECORDS:,} records over {SOURCES} sources, {BATCH} prompts × {GROUP} completions "
        f"per step, statistics lag {LAG}, {seeds} seed{'s' if seeds != 1 else ''} (the same for every curriculum), "
        f"at most {steps} steps",
    ]
    tables: dict[str, list[Summary]] = {}
    for learner in LEARNERS:
        mine = [r for r in learn["runs"] if r["learner"] == learner.name]
        tables[learner.name] = summarise(mine, [*(v.name for v in VARIANTS), ORACLE])
        lines += [learning_table(tables[learner.name], steps, learner.name), ""]
    per_source = LEARNERS[0].name
    lag_summaries = summarise(learn["lags"], [0, 1, 2], key="lag")
    lines += [lag_table(lag_summaries, steps, learn["best"][per_source]), ""]
    source_rows = {s.name: s for s in tables[per_source]}
    base = source_rows["uniform"]
    ratio = _ratio(source_rows["learning_progress"].median, base.median)
    lines.append(
        f"goal: learning_progress without gates ≤ {LEARNING_PROGRESS_GOAL}× uniform's steps (per-source learner): "
        + _verdict(ratio, LEARNING_PROGRESS_GOAL, steps)
    )
    refilled = source_rows["learning_progress + refill"]
    ratio = _ratio(refilled.median_rollouts, base.median_rollouts)
    lines.append(
        f"goal: learning_progress + refill ≤ {REFILL_ROLLOUTS_GOAL}× uniform's rollouts (per-source learner): "
        + _verdict(ratio, REFILL_ROLLOUTS_GOAL, steps)
    )
    share = refilled.trained_zero_variance
    lines.append(
        f"goal: learning_progress + refill trains on ≤ {REFILL_ZERO_VARIANCE_GOAL:.0%} zero-variance groups "
        f"(per-source learner): {'met' if share <= REFILL_ZERO_VARIANCE_GOAL else 'missed'} ({share:.1%})"
    )
    per_record = LEARNERS[1].name
    record_rows = {s.name: s for s in tables[per_record]}
    best = record_rows[learn["best"][per_record]]
    ratio = _ratio(best.median, record_rows["uniform"].median)
    lines.append(
        f"goal: best per-record sampler ({best.name}) ≤ {PER_RECORD_GOAL}× uniform's steps (per-record learner): "
        + _verdict(ratio, PER_RECORD_GOAL, steps)
    )
    if "draw_costs" in out:
        lines += ["", draw_cost_table(out["draw_costs"])]
    if "latency" in out:
        lines += ["", latency_table(out["latency"], out["latency_records"])]
        adaptive = [r for r in out["latency"] if r["sampler"] != "uniform"]
        slowest = max(adaptive, key=lambda r: r["sample_p99_ms"])
        met = all(r["sample_p99_ms"] <= P99_TARGET_MS for r in adaptive)
        lines.append(
            f"goal: /sample p99 ≤ {P99_TARGET_MS:g} ms with each adaptive sampler at "
            f"{out['latency_records']:,} records: {'met' if met else 'missed'} "
            f"(slowest: {slowest['sampler']}, {slowest['sample_p99_ms']:.1f} ms)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench curriculum_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per curriculum, the same for each (default 5)")
    parser.add_argument("--steps", type=int, default=600, help="most steps of one run (default 600)")
    parser.add_argument("--latency-iterations", type=int, default=300, help="timed /sample calls per sampler")
    parser.add_argument("--warm-up", type=int, default=30, help="untimed iterations before them (default 30)")
    parser.add_argument("--records", type=int, default=1_000_000, help="records of the latency curriculum's source")
    parser.add_argument("--skip-latency", action="store_true", help="only the simulated learning (no server)")
    parser.add_argument(
        "--quick", action="store_true", help="1 seed, ≤ 60 steps, 30 timed iterations over 10^5 records: a smoke run"
    )
    args = parser.parse_args(list(argv))
    if args.quick:
        args.seeds, args.steps, args.latency_iterations, args.warm_up, args.records = 1, 60, 30, 5, 100_000
    if args.seeds < 1 or args.steps < SOURCES or args.latency_iterations < 1 or args.warm_up < 0 or args.records < 1:
        parser.error(f"need --seeds ≥ 1, --steps ≥ {SOURCES}, --latency-iterations ≥ 1, --warm-up ≥ 0, --records ≥ 1")
    out = run(args.seeds, args.steps, args.latency_iterations, args.warm_up, args.records, args.skip_latency)
    save("curriculum_sim", out)
    print(report(out))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
