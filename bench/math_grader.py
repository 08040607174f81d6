"""Bare speed of the built-in ``math`` grader in one process, before and after its plain-number fast path.

Two answer sets, each graded by both, in this process, one completion after another:

- plain-number answers: references such as ``42``, ``1,234``, ``3/4``, ``-7``, ``0.25``, and completions
  ``<think>…</think>`` + a plain number, right (in another form: ``0.75`` for ``3/4``) or wrong;
- LaTeX answers: references such as ``\\frac{\\sqrt{2}}{2}``, ``x^2+1``, ``\\pi/4``, ``(1, 2]``, and
  completions ending in a ``\\boxed{…}`` that is right or wrong.

"before" is the ``math`` grader of the baseline commit (``bench._baseline``), read with git: math_verify alone,
the reference parsed on every call (wrapped in ``\\boxed{}`` when it has no LaTeX delimiter), the response
parsed with math_verify's default configs, then ``verify``. "after" is
:func:`proctor.server.grading.builtin.math`, its reference cache cold at the start.
Every completion differs in its reasoning, and most answers in their text too (``\\frac{3\\pi}{12}``,
``\\frac{4\\pi}{16}``, …; every LaTeX one), so math_verify's own 20-entry caches of parsed text rarely answer
a completion from an earlier one; they do keep the few references parsed for "before", as they did for the
old grader. Each run stops after ``COMPLETIONS`` completions or ``SECONDS``, whichever comes first; both
graders see the same completions in the same order, and their verdicts are compared.
"""

from __future__ import annotations

import functools
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version

from bench._baseline import BASELINE, available, old_module
from bench._results import save
from proctor.server.grading import builtin
from proctor.server.grading.base import GradeInput

COMPLETIONS = 20_000
SECONDS = 3.0
TIMEOUT_S = 5.0

Grader = Callable[[GradeInput], float]


@dataclass
class Row:
    answers: str
    grader: str
    completions: int
    seconds: float
    right: int  # completions scored 1.0
    differing: int  # verdicts that differ from the other grader's on the same completions

    @property
    def per_second(self) -> float:
        return self.completions / self.seconds

    @property
    def us_per_completion(self) -> float:
        return self.seconds / self.completions * 1e6


def graders(ref: str = BASELINE) -> tuple[Grader, Grader]:
    """``(before, after)``: the ``math`` grader of commit ``ref``, read from git, and today's."""
    old = old_module("server/grading/builtin.py", ref)
    return functools.partial(old.math, timeout_s=TIMEOUT_S), functools.partial(builtin.math, timeout_s=TIMEOUT_S)


# --- the answer sets ----------------------------------------------------------------------------------------

# reference -> (right answers, wrong answers), templates filled in with k = 1, 2, ... (see _fill), so that no
# two completions give the same answer text.
_PLAIN: dict[str, tuple[list[str], list[str]]] = {
    "42": (["42", "\\boxed{{42}}", "42.0", "{42k}/{k}"], ["{w}1", "-42", "42{k}"]),
    "1,234": (["1234", "1,234", "$1{{,}}234$", "{1234k}/{k}"], ["{w}1", "1,24{d}", "12{k}0"]),
    "3/4": (["0.75", "\\frac{{{3k}}}{{{4k}}}", "{3k}/{4k}"], ["{w}/5", "0.7{d}1", "\\frac{{{4k}}}{{{3k}}}"]),
    "-7": (["-7", "\\boxed{{-7}}", "-{7k}/{k}"], ["7", "-{w}.5", "-7.{k}"]),
    "0.25": ([".25", "1/4", "{k}/{4k}"], ["0.{w}9", "{k}/{3k}", "2.5"]),
    "600/7": (["\\frac{{{600k}}}{{{7k}}}", "{600k}/{7k}", "$\\dfrac{{600}}{{7}}$"], ["85.{w}9", "{w}1/7", "86"]),
    "0.5": (["1/2", "\\boxed{{0.5}}", "{k}/{2k}"], ["0.{w}1", "1/{k2}", "5"]),
}
_LATEX: dict[str, tuple[list[str], list[str]]] = {
    "\\frac{\\sqrt{2}}{2}": (
        ["\\frac{{{k}\\sqrt{{2}}}}{{{2k}}}", "\\frac{{{k}}}{{{k}\\sqrt{{2}}}}"],
        ["\\frac{{\\sqrt{{2}}}}{{{k2}}}", "\\sqrt{{{k2}}}"],
    ),
    "x^2+1": (["x^2 + {k1} - {k}", "{k1}x^2 + 1 - {k}x^2"], ["x^2 + {k1}", "{k1}x^2 + 1"]),
    "\\pi/4": (["\\frac{{{k}\\pi}}{{{4k}}}", "\\frac{{\\pi}}{{4}} + {k} - {k}"], ["\\frac{{\\pi}}{{{k4}}}", "{k}\\pi"]),
    "(1, 2]": (["(\\frac{{{k}}}{{{k}}}, 2]", "(1, \\frac{{{2k}}}{{{k}}}]"], ["[1, {k1}]", "(1, {k2}]"]),
    "2\\sqrt{3}": (
        ["\\sqrt{{12}} + {k} - {k}", "\\frac{{{2k}\\sqrt{{3}}}}{{{k}}}"],
        ["{k2}\\sqrt{{3}}", "\\sqrt{{{k2}}} + 1"],
    ),
    "\\{1, 2\\}": (
        ["\\{{2, \\frac{{{k}}}{{{k}}}\\}}", "\\{{\\frac{{{2k}}}{{{k}}}, 1\\}}"],
        ["\\{{1, {k2}\\}}", "\\{{{k2}\\}}"],
    ),
}
# How each set's completions end: the plain-number answer bare, the LaTeX one boxed in a sentence.
ANSWER_SETS = [
    ("plain-number answers", _PLAIN, "{}"),
    ("LaTeX answers", _LATEX, "So the answer is $\\boxed{{{}}}$."),
]


def _fill(template: str, k: int, rng: random.Random) -> str:
    return template.format(
        k=k,
        k1=k + 1,
        k2=k + 2,
        k4=k + 4,
        **{f"{m}k": m * k for m in (2, 3, 4, 7, 42, 600, 1234)},
        d=rng.randrange(10),
        w=rng.randrange(1, 10**6),
    )


def completions(
    answers: dict[str, tuple[list[str], list[str]]], ending: str, n: int, *, seed: int = 0
) -> list[GradeInput]:
    """``n`` distinct completions to the references in ``answers``, about half of them right."""
    rng = random.Random(seed)
    references = list(answers)
    out = []
    for k in range(1, n + 1):
        reference = references[k % len(references)]
        right, wrong = answers[reference]
        answer = _fill(rng.choice(right if rng.random() < 0.5 else wrong), k, rng)
        think = f"<think>Attempt {k}: {rng.randrange(10**9)} is too far off, so I redo the sum step by step.</think>"
        out.append(GradeInput(prompt="", completion=think + ending.format(answer), answer=reference))
    return out


def time_grader(grader: Grader, samples: list[GradeInput], seconds: float) -> tuple[list[float], float]:
    """``grader``'s verdicts on ``samples``, one after another in this process, stopping once ``seconds`` have
    passed; and the seconds taken."""
    verdicts: list[float] = []
    started = time.perf_counter()
    deadline = started + seconds
    for s in samples:
        verdicts.append(grader(s))
        if time.perf_counter() >= deadline:
            break
    return verdicts, time.perf_counter() - started


def run(n: int = COMPLETIONS, seconds: float = SECONDS) -> tuple[list[Row], dict[str, object]]:
    """Grade both answer sets with both graders; a row per (answer set, grader)."""
    before, after = graders()
    # Imported and warmed first, so that neither grader's time includes loading sympy.
    before(GradeInput(prompt="", completion="\\boxed{1}", answer="1"))
    rows: list[Row] = []
    for name, answers, ending in ANSWER_SETS:
        samples = completions(answers, ending, n)
        builtin._parsed_reference.cache_clear()
        old, old_s = time_grader(before, samples, seconds)
        new, new_s = time_grader(after, samples, seconds)
        both = min(len(old), len(new))
        differing = sum(a != b for a, b in zip(old[:both], new[:both], strict=True))
        rows.append(Row(name, "before", len(old), old_s, int(sum(old)), differing))
        rows.append(Row(name, "after", len(new), new_s, int(sum(new)), differing))
    env: dict[str, object] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "math_verify": version("math-verify"),
        "sympy": version("sympy"),
        "limit": f"{n} completions or {seconds:g} s per run",
    }
    return rows, env


def speedups(rows: list[Row]) -> dict[str, float]:
    """After's completions per second over before's, per answer set."""
    rate = {(r.answers, r.grader): r.per_second for r in rows}
    return {
        answers: rate[(answers, "after")] / rate[(answers, "before")] for answers, grader in rate if grader == "after"
    }


def table(rows: list[Row]) -> str:
    lines = [
        "| answers | grader | completions | right | completions/s | µs/completion | speed-up | verdicts differing |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    speedup = speedups(rows)
    for r in rows:
        ratio = f"{speedup[r.answers]:.1f}×" if r.grader == "after" else ""
        lines.append(
            f"| {r.answers} | {r.grader} | {r.completions} | {r.right} | {r.per_second:,.0f} | "
            f"{r.us_per_completion:,.1f} | {ratio} | {r.differing} |"
        )
    return "\n".join(lines)


def main() -> None:
    if not available():
        print(f"math grader: commit {BASELINE} is not in this clone (a shallow one?), so there is no before to time")
        return
    rows, env = run()
    print(f"math grader, one process, {env['limit']}, Python {env['python']}, math-verify {env['math_verify']}")
    print(table(rows))
    payload = {
        "env": env,
        "rows": [asdict(r) | {"per_second": r.per_second, "us_per_completion": r.us_per_completion} for r in rows],
        "speedup": speedups(rows),
    }
    save("math_grader", payload)


if __name__ == "__main__":
    main()
