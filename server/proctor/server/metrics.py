"""Prometheus metrics, in a registry owned by one app (so that tests can run several apps side by side)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from proctor.server.state.rows import GradeRow

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "proctor_requests",
            "HTTP requests by route and status.",
            ["method", "route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "proctor_request_duration_seconds",
            "HTTP request latency by route.",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.samples = Counter(
            "proctor_samples", "Prompts served, by stage and source.", ["stage", "source"], registry=r
        )
        self.grades = Counter(
            "proctor_grades",
            "Completions graded (first time only), by stage and source.",
            ["stage", "source"],
            registry=r,
        )
        self.grades_cached = Counter(
            "proctor_grades_cached", "Grades answered from the store (repeated posts).", registry=r
        )
        self.graded_standing_by = Counter(
            "proctor_graded_standing_by",
            "Completions this process graded while it stood by, stored by the server that serves its database.",
            registry=r,
        )
        self.reward = Histogram(
            "proctor_reward",
            "Rewards of error-free grades, by stage.",
            ["stage"],
            buckets=_REWARD_BUCKETS,
            registry=r,
        )
        self.grader_errors = Counter(
            "proctor_grader_errors",
            "Completions whose grading failed, by grader and kind (error, timeout, crash, remote, stale).",
            ["grader", "kind"],
            registry=r,
        )
        self.grader_seconds = Histogram(
            "proctor_grading_duration_seconds",
            "Time to grade the completions of one /grade request in the grader processes.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.current_stage = Gauge("proctor_current_stage", "Index of the current curriculum stage.", registry=r)
        self.stage_active = Gauge(
            "proctor_stage_active", "1 for the current stage, 0 for the others.", ["stage"], registry=r
        )
        self.rolling_reward = Gauge(
            "proctor_stage_rolling_reward",
            "Mean reward over each stage's gate window.",
            ["stage"],
            registry=r,
        )
        self.last_iteration = Gauge("proctor_last_iteration", "Highest iteration sampled so far.", registry=r)
        self.transitions = Counter("proctor_stage_transitions", "Stage transitions recorded.", registry=r)
        self.refilled_groups = Counter(
            "proctor_refilled_groups",
            "Groups replaced by refill rounds (POST /refill), by stage.",
            ["stage"],
            registry=r,
        )
        self.serving = Gauge(
            "proctor_serving",
            "1 while this process serves its state; 0 while it stands by for another server of its database, or "
            "opens its state again.",
            registry=r,
        )

    def publish_stage(self, stages: Sequence[str], current: int) -> None:
        """The current stage (an index into the curriculum's ``stages``, by name), after a transition or a
        restart."""
        self.current_stage.set(current)
        for index, name in enumerate(stages):
            self.stage_active.labels(name).set(1 if index == current else 0)

    def count_grades(
        self, stages: Sequence[str], rows: Iterable[GradeRow], rolling: Mapping[int, float | None]
    ) -> None:
        """Newly stored error-free grades, and the rolling rewards of the stages they moved (by stage index;
        None while a stage has none)."""
        per_source: dict[tuple[int, str], int] = {}
        per_stage: dict[int, list[float]] = {}
        for row in rows:
            if row.error is None:
                per_source[row.stage, row.source] = per_source.get((row.stage, row.source), 0) + 1
                per_stage.setdefault(row.stage, []).append(row.reward)
        for stage, rewards in per_stage.items():
            histogram = self.reward.labels(stages[stage])  # a look-up a stage, not a completion
            for value in rewards:
                histogram.observe(value)
        for (stage, source), n in per_source.items():
            self.grades.labels(stages[stage], source).inc(n)
        for stage, reward in rolling.items():
            if reward is not None:
                self.rolling_reward.labels(stages[stage]).set(reward)
