"""Records from a reasoning-core task (the optional ``reasoning-core`` extra).

Record ``k`` is an item of the task at the source's ``level``, made by the task's own ``generate_example`` from a
seed derived from the curriculum's seed, the source's name and ``k``, when first asked for, and then kept in a
cache. Most items take milliseconds; at level 5 a few tasks take seconds.

A record must be the same in every process (a restarted server, a second replica), and reasoning-core's items are
not, left to themselves: its generators draw from the process's ``random``, ``numpy.random`` and Faker states and
never seed them; gramforge reseeds ``random`` from the OS for every expression; some tasks make a
``random.Random()`` or a ``numpy.random.default_rng()`` without a seed, and some balance their labels over the
items they made before; ``generate_example`` runs under a ``SIGALRM`` timeout whose retries go on from wherever the
random state then is, and drops items longer than a token count made with tiktoken where it is installed and in
words where not; and over a quarter of the tasks iterate over sets of strings, whose order changes with the
interpreter's hash seed. So the items are made in a process of their own (:class:`_Generator`, one for each
server process), started with ``PYTHONHASHSEED=0`` and with the reseeding, the unseeded generators and the timeout
switched off (:func:`_determinise`). Each item is made by a fresh copy of its task, with ``random``,
``numpy.random`` and Faker's generator seeded for it, and ``max_tokens=0``. The server's own random state, signals
and threads are left alone, and a generator process that dies is started again for the next record.

Tasks whose items depend on the machine all the same (its speed) or need what is not there (the network, the
``gen`` extra) are refused, with the reason (``_EXCLUDED``); so are levels at which a task is too slow to make
items on demand (``_TOP_LEVELS``).

reasoning-core is imported when a source is built, never when this module is: curricula without such a source
load without the extra.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import difflib
import functools
import hashlib
import importlib
import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from proctor.server.grading.base import GradeInput
from proctor.server.grading.builtin import REASONING_CORE_METADATA, import_reasoning_core
from proctor.server.grading.builtin import reasoning_core as grade_reasoning_core
from proctor.server.sources.base import Record, Source, content_version
from proctor.server.sources.files import SourceDataError
from proctor.server.sources.knobs import config_knobs, reason
from proctor.server.spec import ReasoningCoreSourceSpec

__all__ = ["ReasoningCoreSource"]

# Bump when the mapping from items to records changes: the version (and so every sample id) changes with it.
_FORMAT = "reasoning_core/1"
# As for reasoning_gym: /grade looks up the records /sample just made, and some tasks take seconds per item.
_CACHED_RECORDS = 4096
# The spec's bound on `level`: reasoning-core's levels run from 0 to 5.
_TOP_LEVEL = 5
# proctor sets these itself: the level from the source's own field, the seed from the curriculum's, and the size
# (a field of every reasoning-core config that its tasks do not read) from the source's own field.
_RESERVED = ("level", "seed", "size")
# What reasoning-core adds to an item's metadata about how it was made rather than what it is: the seconds it took,
# the git commit of the checkout it was made from (proctor's own, where the virtualenv sits inside proctor's tree),
# and token counts with whichever tokenizer is installed. Left out, so that a record is the same wherever it is made.
_VOLATILE = frozenset({"_time", "_generator_commit", "_prompt_tokens", "_answer_tokens", "_cot_tokens"})
# A few seeds fail (constraint_satisfaction gives up on some schedules): record k then tries the next of its seeds.
_SEEDS_PER_RECORD = 4

_WALL_CLOCK = "its items depend on the machine's speed"
_EXCLUDED: Mapping[str, str] = {
    "code_runnability": f"{_WALL_CLOCK}: it runs the programs it writes in forked processes with a wall-clock timeout",
    "coreference": f"{_WALL_CLOCK}: its solver (z3) stops at a wall-clock timeout",
    "table_qa": "its items depend on the day they are made: its tables hold dates drawn relative to today (Faker's "
    "date_between('-1y') and date_between('-18M', 'today')), and two processes were seen to make different records",
    "game_best_move": "it needs reasoning-core's `gen` extra (pyggp)",
    "game_forced_win": "it needs reasoning-core's `gen` extra (pyggp)",
    "inverse_math": f"{_WALL_CLOCK}: it gives up on sympy work after a second of SIGALRM",
    "metamath_core_select": "it downloads its axiom database from the network when first used",
    "metamath_entailment": "it downloads its axiom database from the network when first used",
    "regex_following": f"{_WALL_CLOCK}: it stops regular-expression matches at wall-clock timeouts",
    "regex_reasoning": f"{_WALL_CLOCK}: it stops regular-expression matches at wall-clock timeouts",
}
# The highest level of a task that is too slow to make items on demand above it, and why.
_TOP_LEVELS: Mapping[str, tuple[int, str]] = {
    "sequential_induction": (3, "an item takes up to 12 s at level 4 and 35 s at level 5"),
}


class ReasoningCoreSource(Source):
    """``size`` records of one reasoning-core task at one level; the level is the source's difficulty."""

    kind = "reasoning_core"

    def __init__(self, name: str, spec: ReasoningCoreSourceSpec, seed: int) -> None:
        try:
            import_reasoning_core("the reasoning_core source kind")
        except ImportError as exc:
            raise SourceDataError("kind", str(exc)) from None
        package = importlib.metadata.version("reasoning-core")
        version = content_version(_FORMAT, package, seed, name, spec.task, spec.level, spec.config, spec.size)
        super().__init__(name, version)
        self.spec = spec
        self._task = {"task": spec.task, "config": spec.config, "seed": _source_seed(seed, name)}
        self._scoring = {"task": spec.task, "level": spec.level, "config": spec.config}
        # /grade looks up the records /sample just generated; regenerating one can cost more than keeping it.
        self.record = functools.lru_cache(maxsize=_CACHED_RECORDS)(self._generate)  # type: ignore[method-assign]
        # The generator process checks the task, its config and level, and grades record 0's own answer.
        reply = _generator().ask(["check", self._task, spec.level])
        if reply[0] != "ok":
            field, message = (reply[1], reply[2]) if reply[0] == "invalid" else ("task", reply[1])
            raise SourceDataError(field, message)

    @property
    def size(self) -> int:
        return self.spec.size

    def record(self, key: int) -> Record:
        return self._generate(key)

    def derived_difficulty(self) -> float:
        """The level, from 0 (level 0) to 1 (level 5).

        The numbers compare sources of one task, not tasks with each other: level 0 of one task may be harder than
        level 5 of another. Give sources a ``difficulty`` to rank tasks.
        """
        return self.spec.level / _TOP_LEVEL

    def _generate(self, key: int) -> Record:
        if not 0 <= key < self.spec.size:
            raise KeyError(key)
        reply = _generator().ask(["item", self._task, self.spec.level, key])
        if reply[0] != "ok":
            raise RuntimeError(f"reasoning-core could not make record {key} of {self.spec.task!r}: {reply[1]}")
        prompt, answer, metadata = reply[1:]
        metadata[REASONING_CORE_METADATA] = self._scoring
        return Record(key, prompt, answer, system_prompt=self.spec.system_prompt, metadata=metadata)


def _source_seed(seed: int, name: str) -> int:
    """A seed per (curriculum seed, source name), so that two sources of one task serve different items."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def _record_seeds(seed: int, key: int) -> list[int]:
    """Record ``key``'s seeds: the first for its item, the next ones in turn if the task fails with those before."""
    return [
        int.from_bytes(hashlib.sha256(f"{seed}:{key}:{attempt}".encode()).digest()[:8], "big")
        for attempt in range(_SEEDS_PER_RECORD)
    ]


# --- in the server: the generator process --------------------------------------------------------------------

_CHILD = "from proctor.server.sources.reasoning_core import _serve; _serve()"


class _Generator:
    """The process that makes the items of every reasoning_core source of this process, one request at a time.

    A request and its reply are a line of JSON each, on the process's standard input and output. The process is
    started on the first request, and again on the first one after it has died (a request it dies on fails); it
    ends when this process exits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None
        atexit.register(self.close)

    def ask(self, request: list[Any]) -> list[Any]:
        line = json.dumps(request) + "\n"
        with self._lock:
            if self._process is not None and self._process.poll() is not None:
                self._stop()  # it died since the last request
            if self._process is None:
                self._process = _start()
            process = self._process
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write(line)
                process.stdin.flush()
                reply = process.stdout.readline()
            except OSError:
                reply = ""
            if not reply:
                self._stop()
                return ["error", f"reasoning-core's generator process ended (exit code {process.returncode})"]
        answer: list[Any] = json.loads(reply)
        return answer

    def close(self) -> None:
        # At exit a daemon thread may still be waiting for an item: do not wait for it for long.
        if self._lock.acquire(timeout=10):
            try:
                self._stop()
            finally:
                self._lock.release()

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        with contextlib.suppress(OSError):  # a broken pipe: the process is gone already
            process.stdin.close()  # the process ends when its input does
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def _start() -> subprocess.Popen[str]:
    # The server's own import path, so that the process finds proctor wherever the server found it.
    path = os.pathsep.join(p for p in sys.path if p)
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": path},
    )


_generators: dict[int, _Generator] = {}  # by process id: a forked server starts a generator of its own
_generators_lock = threading.Lock()


def _generator() -> _Generator:
    with _generators_lock:
        pid = os.getpid()
        if pid not in _generators:
            _generators[pid] = _Generator()
        return _generators[pid]


# --- in the generator process ----------------------------------------------------------------------------------


def _serve() -> None:
    """The generator process: answer each request on standard input with a line on standard output."""
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # what a task prints goes to standard error, not among the replies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the server ends this one
    rc = importlib.import_module("reasoning_core")
    _determinise()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = _answer(rc, request)
        except SourceDataError as exc:
            reply = ["invalid", exc.field, str(exc)]
        except Exception as exc:
            reply = ["error", reason(exc)]
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _answer(rc: Any, request: list[Any]) -> list[Any]:
    kind, task, level = request[:3]
    prototype = _prototype(rc, task["task"], json.dumps(task["config"], sort_keys=True), task["seed"])
    _check_level(task["task"], level)
    if kind == "item":
        item = _item(prototype, level, _record_seeds(task["seed"], request[3]))
        metadata = json.loads(json.dumps({k: v for k, v in item.metadata.items() if k not in _VOLATILE}))
        return ["ok", str(item.prompt), None if item.answer is None else str(item.answer), metadata]
    _check_grading(task, prototype, level)
    return ["ok"]


def _check_level(task: str, level: int) -> None:
    top, why = _TOP_LEVELS.get(task, (_TOP_LEVEL, ""))
    if level > top:
        raise SourceDataError("level", f"proctor serves {task!r} up to level {top}: {why}")


def _check_grading(task: Mapping[str, Any], prototype: Any, level: int) -> None:
    """Make record 0 and grade its own answer as the grader will, so that a config the task cannot generate with, or
    a task the grader cannot score, fails when the curriculum loads."""
    name = task["task"]
    try:
        item = _item(prototype, level, _record_seeds(task["seed"], 0))
    except Exception as exc:  # a task reads its knobs only when it makes an item
        raise SourceDataError(
            "config", f"reasoning-core cannot generate {name!r} items with this config: {reason(exc)}"
        ) from None
    answer = None if item.answer is None else str(item.answer)
    metadata = json.loads(json.dumps({k: v for k, v in item.metadata.items() if k not in _VOLATILE}))
    metadata[REASONING_CORE_METADATA] = {"task": name, "level": level, "config": task["config"]}
    sample = GradeInput(str(item.prompt), f"<answer>{answer}</answer>", answer, metadata)
    try:
        score = grade_reasoning_core(sample)
    except Exception as exc:
        raise SourceDataError(
            "task", f"reasoning-core's scorer fails on {name!r} record 0's own answer: {reason(exc)}"
        ) from None
    if score != 1.0:
        raise SourceDataError(
            "task",
            f"reasoning-core's scorer gives {name!r} record 0's own answer {score}, not 1, once its metadata has been "
            "through JSON as every record's does; proctor cannot grade this task, choose another",
        )


@functools.lru_cache(maxsize=64)
def _prototype(rc: Any, task: str, config_json: str, seed: int) -> Any:
    """The task as configured, never used itself: each item is made by a copy of it."""
    config: dict[str, Any] = json.loads(config_json)
    package = importlib.metadata.version("reasoning-core")
    if task in _EXCLUDED:
        raise SourceDataError("task", f"proctor cannot serve reasoning-core's {task!r}: {_EXCLUDED[task]}")
    served = sorted(t for t in rc.list_tasks() if t not in _EXCLUDED)
    if task not in served:
        close = difflib.get_close_matches(task, served, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise SourceDataError(
            "task", f"reasoning-core {package} has no task {task!r}{hint} The tasks proctor serves: {', '.join(served)}"
        )
    reserved = [k for k in _RESERVED if k in config]
    if reserved:
        raise SourceDataError(
            "config",
            f"{' and '.join(reserved)} cannot be set in config: proctor takes the level and the size from the source's "
            "own `level` and `size`, and derives the seed from the curriculum's seed",
        )
    _seed(seed)  # a task's constructor may draw from the random state too
    default = rc.get_task(task)
    config_cls = type(default.config)
    knobs = config_knobs(config_cls, _RESERVED)
    listing = f"its knobs (with defaults): {', '.join(f'{k}={v!r}' for k, v in knobs.items())}"
    unknown = [k for k in config if k not in knobs]
    if unknown:
        raise SourceDataError("config", f"{task!r} has no knob {', '.join(map(repr, unknown))}; {listing}")
    if not config:
        return default
    try:
        _seed(seed)
        return rc.get_task(task, config=config_cls(**config))
    except Exception as exc:  # the config's own __post_init__ or the task's constructor
        raise SourceDataError(
            "config", f"reasoning-core rejected the config of {task!r}: {reason(exc)}; {listing}"
        ) from None


def _item(prototype: Any, level: int, seeds: list[int]) -> Any:
    """An item of a fresh copy of the task at ``level``, from the first of ``seeds`` the task does not fail on."""
    for seed in seeds[:-1]:
        _seed(seed)
        try:
            # A fresh copy: nothing of the items made before, which some tasks balance their labels over.
            return copy.deepcopy(prototype).generate_example(level=level, max_tokens=0)
        except Exception:  # that seed's failure is as reproducible as its item would have been: try the next one
            continue
    _seed(seeds[-1])
    return copy.deepcopy(prototype).generate_example(level=level, max_tokens=0)


_FAKER_RANDOM: list[random.Random] = []  # Faker's shared generator, once the process has imported Faker


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(random.getrandbits(32))
    for generator in _FAKER_RANDOM:
        generator.seed(random.getrandbits(64))


def _determinise() -> None:
    """Make what reasoning-core draws depend on the seeds :func:`_seed` sets alone, for the rest of this process."""
    module_seed, instance_seed, default_rng = random.seed, random.Random.seed, np.random.default_rng

    def keep_state(a: Any = None, version: int = 2) -> None:
        if a is not None:  # gramforge's random.seed(None) would reseed from the OS
            module_seed(a, version)

    def seed_from_random(self: random.Random, a: Any = None, version: int = 2) -> None:
        instance_seed(self, random.getrandbits(64) if a is None else a, version)

    def default_rng_from_random(seed: Any = None) -> np.random.Generator:
        return default_rng(random.getrandbits(64) if seed is None else seed)

    def no_timeout(seconds: int = 15, attempts: int = 10) -> Callable[[Any], Any]:
        return lambda fn: fn

    template = importlib.import_module("reasoning_core.template")
    replaced = [
        (random, "seed", keep_state),
        (random.Random, "seed", seed_from_random),
        (np.random, "default_rng", default_rng_from_random),
        (template, "timeout_retry", no_timeout),  # generate_example looks it up on every call
    ]
    for owner, name, replacement in replaced:
        setattr(owner, name, replacement)
    # Faker makes its shared generator when first imported: import it now, so that it is seeded for every item.
    _FAKER_RANDOM.append(importlib.import_module("faker.generator").random)
    # reasoning-core loads its tokenizer once and warns that max_tokens counts words where tiktoken is missing;
    # max_tokens=0 counts nothing.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tiktoken o200k_base unavailable", category=UserWarning)
        importlib.import_module("reasoning_core.runtime").load_tokenizer()
