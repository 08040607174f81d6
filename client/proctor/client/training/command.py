"""``proctor train``: GRPO with TRL against a running dataserver (``proctor demo`` runs it, in ``proctor.cli.demo``).

    proctor train --server http://127.0.0.1:8000 --model Qwen/Qwen2.5-0.5B-Instruct --max-steps 200
    proctor train --model tiny            # a tiny model built offline (no hub), for trying things on a CPU

The trainer is ``ProctorGRPOTrainer`` (``proctor.client.training.trainer``): TRL's ``GRPOTrainer`` with the rollout's
passes batched by rows or by token budget, as the ``--rollout-micro-batch-size`` / ``--max-tokens-per-microbatch-*``
flags say. Prompts come from the server's curriculum (``RemoteRLDataset``) and rewards from its graders
(``remote_reward``); each step prints the curriculum stage, the mean reward and, when passes are packed by
token budget, their micro-batch counts and padding.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

from proctor.client.dataset import RemoteRLDataset
from proctor.client.errors import (
    Conflict,
    DataserverError,
    NotReadyError,
    RequestRejected,
    ServerFailure,
    TransportError,
    Unauthorized,
)
from proctor.client.http import ProctorClient
from proctor.client.rewards import remote_reward
from proctor.client.tiny import build_tiny_model, run_defaults
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer
from proctor.wire.dataserver import Meta

__all__ = ["StepReporter", "build_parser", "config_from_args", "main", "quiet_libraries", "refusal", "train"]

TINY = "tiny"


def _positive(unit: str) -> Callable[[str], int]:
    """An argparse ``type=`` for a count of ``unit`` that must be at least 1; argparse names the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive integer ({unit}), got {text}")
        return value

    return parse


_OWN = object()  # a flag whose default is the configuration field's own


@dataclass(frozen=True)
class _Flag:
    """A field of ``ProctorGRPOConfig`` as a flag of ``proctor train``. Its help is the field's own, followed by
    the default the command gives it."""

    field: str
    default: Any = _OWN
    default_text: str | None = None  # the default in words, where its value alone would not say it
    unit: str | None = None  # a count of this, at least 1
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negated: str | None = None  # a boolean that is on by default: this flag turns it off

    def add_to(self, group: argparse._ActionsContainer) -> None:
        field = _CONFIG_FIELDS[self.field]
        default = field.default if self.default is _OWN else self.default
        said = self.default_text if self.default_text is not None else default
        help_ = f"{field.metadata['help'].rstrip('.')}. (default: {said})"
        if self.negated is not None:
            group.add_argument(self.negated, dest=self.field, action="store_false", help=f"Turns off: {help_}")
            return
        kind: Callable[[str], Any] = str
        if self.unit is not None:
            kind = _positive(self.unit)
        elif self.choices is None:
            kind = float if isinstance(field.default, float) else int
        group.add_argument(
            "--" + self.field.replace("_", "-"),
            type=kind,
            default=default,
            choices=self.choices,
            metavar=self.metavar or (None if self.choices else "X" if kind is float else "N"),
            help=help_,
        )


_CONFIG_FIELDS = {f.name: f for f in fields(ProctorGRPOConfig)}

# The configuration proctor train sets from its flags; the rest of ProctorGRPOConfig is run_defaults' or TRL's.
_TRAINING = (
    _Flag("per_device_train_batch_size", 8, unit="rows"),
    _Flag("num_generations", 4, unit="completions per prompt"),
    _Flag("gradient_accumulation_steps", unit="micro-steps per optimizer step"),
    _Flag(
        "steps_per_generation",
        unit="micro-steps per generation",
        default_text="derived so that every rollout pass cuts whole micro-batches",
    ),
    _Flag("max_steps", None, "the whole curriculum", unit="optimizer steps"),
    _Flag("max_completion_length", 32, unit="tokens"),
    _Flag("learning_rate", None, "1e-4 for the tiny model, 1e-6 for any other"),
    _Flag("beta"),
    _Flag("temperature"),
    _Flag("seed", 0),
)
_BATCHING = (
    _Flag(
        "rollout_micro_batch_size",
        default_text="the whole local generation batch",
        unit="rows per generate call",
        metavar="ROWS",
    ),
    _Flag(
        "ref_logps_micro_batch_size",
        default_text="--per-device-train-batch-size",
        unit="rows per reference forward",
        metavar="ROWS",
    ),
    _Flag(
        "old_logps_micro_batch_size",
        default_text="--per-device-train-batch-size",
        unit="rows per old-policy forward",
        metavar="ROWS",
    ),
    _Flag(
        "max_tokens_per_microbatch_in_infer",
        default_text="by rows",
        unit="tokens per micro-batch",
        metavar="TOKENS",
    ),
    _Flag("sequence_length_round_in_infer", unit="tokens", metavar="TOKENS"),
    _Flag(
        "max_tokens_per_microbatch_in_train",
        default_text="one pass per micro-step",
        unit="tokens per micro-batch",
        metavar="TOKENS",
    ),
    _Flag("sequence_length_round_in_train", unit="tokens", metavar="TOKENS"),
    _Flag("padding_free", choices=("auto", "off")),
    _Flag("balance_ranks_by_tokens", default_text="on", negated="--no-balance-ranks"),
)


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``proctor train``: where to find the server and the model, and the configuration fields
    :data:`_TRAINING` and :data:`_BATCHING` name, each with its field's help."""
    p = argparse.ArgumentParser(prog="proctor train", description="GRPO (TRL) against a proctor dataserver.")
    server = os.environ.get("PROCTOR_URL", "http://127.0.0.1:8000")
    p.add_argument("--server", default=server, help=f"the dataserver's URL (default {server}, env PROCTOR_URL)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PROCTOR_API_KEY"),
        help="the server's API key (default: env PROCTOR_API_KEY)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=60.0,
        help="how long to wait for the dataserver to answer at start (default 60)",
    )
    p.add_argument(
        "--model", default=TINY, help="a Hugging Face model path or id; 'tiny' builds one offline (default tiny)"
    )
    p.add_argument(
        "--tiny-dir", default=".proctor/tiny-model", help="where the tiny model is built (default .proctor/tiny-model)"
    )
    p.add_argument(
        "--output-dir",
        default=".proctor/train",
        help="where the trainer writes (the model with --save) (default .proctor/train)",
    )
    for flag in _TRAINING:
        flag.add_to(p)
    p.add_argument(
        "--on-error",
        choices=["skip", "server"],
        default="skip",
        help="a completion whose grading failed: skip it, or take the source's on_error reward (default skip)",
    )
    p.add_argument(
        "--refill-rounds",
        type=int,
        default=0,
        help="ask the server, up to this many rounds a step, which graded groups to replace (where the stage sets "
        "`refill`), and generate only those again (default 0: none)",
    )
    p.add_argument("--save", action="store_true", help="save the trained model to --output-dir (default: not saved)")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="train in bf16 even where the default would not (default: bf16 on a GPU, fp32 on a CPU)",
    )
    batching = p.add_argument_group(
        "rollout batching",
        "How the rollout's passes are cut into micro-batches: by rows, or packed by a token budget "
        "(rows × padded length). The local generation batch must cut into whole row micro-batches; "
        "--steps-per-generation is derived to make it so unless given.",
    )
    for flag in _BATCHING:
        flag.add_to(batching)
    return p


def config_from_args(args: argparse.Namespace, *, gpu: bool) -> ProctorGRPOConfig:
    """The trainer's configuration from ``args``; a combination it refuses is a ``ValueError`` saying what to change.

    ``max_steps`` stays -1 when ``--max-steps`` is not given: ``train`` sets it from the server's curriculum.
    """
    defaults = run_defaults(args.output_dir, gpu=gpu, seed=args.seed)
    if args.bf16:
        defaults["bf16"] = True
    flagged = {flag.field: getattr(args, flag.field) for flag in (*_TRAINING, *_BATCHING)}
    flagged["learning_rate"] = args.learning_rate or (1e-4 if args.model == TINY else 1e-6)
    flagged["max_steps"] = args.max_steps or -1
    return ProctorGRPOConfig(
        **{**defaults, **flagged},
        shuffle_dataset=False,  # the curriculum's order is the point
        use_dynamic_batching_in_infer=args.max_tokens_per_microbatch_in_infer is not None,
        use_dynamic_batching_in_train=args.max_tokens_per_microbatch_in_train is not None,
    )


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run GRPO as ``args`` say; returns a summary (steps, rewards per step, curriculum transitions).

    A configuration the trainer refuses exits as argparse does (``proctor train: error: ...``, status 2), before
    the server is contacted; so does a dataserver that refuses a request or does not answer, with what to do.
    """
    quiet_libraries()
    gpu = torch.cuda.is_available()
    try:
        config = config_from_args(args, gpu=gpu)
    except ValueError as exc:
        build_parser().error(str(exc))
    tiny = args.model == TINY
    model = str(build_tiny_model(args.tiny_dir)) if tiny else args.model
    if tiny:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    client = ProctorClient(args.server, api_key=args.api_key)
    meta: Meta | None = None
    try:
        client.wait_ready(args.connect_timeout_s)
        meta = client.meta()
        return _run(args, config, model, client, meta)
    except DataserverError as exc:
        # One line, as argparse words its errors, without the usage: the command line was fine.
        message = refusal(exc, server=args.server, run=None if meta is None else meta.run)
        build_parser().exit(2, f"proctor train: error: {message}\n")
    finally:
        client.close()


def _run(
    args: argparse.Namespace, config: ProctorGRPOConfig, model: str, client: ProctorClient, meta: Meta
) -> dict[str, Any]:
    if args.max_steps is None:
        # One optimizer step per curriculum iteration (steps_per_generation = gradient accumulation by default).
        config.max_steps = meta.total_iterations
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = RemoteRLDataset(client, config, processing_class=tokenizer)
    is_main = config.process_index == 0
    progress = StepReporter(dataset, is_main=is_main)
    try:
        trainer = ProctorGRPOTrainer(
            model=model,
            reward_funcs=remote_reward(client, on_error=args.on_error, dataset=dataset),
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[progress],
            refill_rounds=args.refill_rounds,
        )
        # The reporter prints one line per step; transformers' own printer would add the whole logs dict.
        trainer.remove_callback(PrinterCallback)
        if is_main:
            print(
                f"training {model} on {meta.curriculum!r} ({meta.total_iterations} iterations, "
                f"{dataset.layout.prompts_per_generation} prompts × {config.num_generations} completions per step) "
                f"for {config.max_steps} steps",
                flush=True,
            )
            print(f"  batch sizes: {config.batch_sizes.describe()}", flush=True)
            packed = _packing_text(config)
            if packed:
                print(f"  packed by token budget: {packed}", flush=True)
        trainer.train()
    finally:
        dataset.close()
    if args.save:
        trainer.save_model(args.output_dir)
    state = client.curriculum()
    if is_main:
        print("curriculum transitions:")
        for t in state.transitions or []:
            print(f"  iteration {t.iteration:>4}: {t.from_stage} → {t.to_stage} ({t.reason})")
        if not state.transitions:
            print("  none")
    return {"steps": progress.steps, "transitions": [t.model_dump() for t in state.transitions]}


def refusal(exc: DataserverError, *, server: str, run: str | None) -> str:
    """One line for a dataserver error that stopped training: what the server said, and what to do about it."""
    said = " ".join(str(getattr(exc, "detail", exc)).split())
    if isinstance(exc, Conflict):
        which = "the dataserver's run" if run is None else f"the dataserver's run {run!r}"
        return (
            f"{which} holds what another client asked for, and this training asks otherwise ({said}); start the "
            "run over with `proctor serve --fresh` (`make serve ARGS=--fresh`), or another run with "
            "`proctor serve --run NAME`"
        )
    if isinstance(exc, Unauthorized):
        return f"the dataserver at {server} wants its API key: pass --api-key KEY, or set PROCTOR_API_KEY ({said})"
    if isinstance(exc, NotReadyError | TransportError):
        return (
            f"no dataserver answers at {server}: start one with `make serve` (or `proctor serve`), or pass --server URL"
        )
    if isinstance(exc, RequestRejected):
        return f"the dataserver refused a request ({exc.status_code}): {said}"
    if isinstance(exc, ServerFailure):
        return f"the dataserver failed ({exc.status_code}: {said}); its log says why"
    return said


# Deprecations that TRL 1.16 triggers inside transformers 5 on every step: nothing a user of `proctor train` can
# act on, and they would bury the step lines.
_LIBRARY_NOISE = ("`is_gradient_checkpointing` is deprecated", "`gradient_checkpointing` is deprecated")


def quiet_libraries() -> None:
    """Keep the libraries' progress bars and deprecation notices out of the run's output: its lines are its steps."""
    import warnings

    from huggingface_hub.utils.tqdm import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    for message in _LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    # transformers read the hub's setting once, when imported: both are switched off.
    disable_transformers_bars: Callable[[], None] = transformers_logging.disable_progress_bar
    disable_transformers_bars()
    disable_progress_bars()


def _packing_text(config: ProctorGRPOConfig) -> str:
    """The token budgets of the packed passes, e.g. ``log-prob passes ≤ 64 tokens (round 1); training ≤ 48 ...``."""
    parts = []
    if config.use_dynamic_batching_in_infer:
        parts.append(
            f"log-prob passes ≤ {config.max_tokens_per_microbatch_in_infer} tokens "
            f"(round {config.sequence_length_round_in_infer})"
        )
    if config.use_dynamic_batching_in_train:
        parts.append(
            f"training ≤ {config.max_tokens_per_microbatch_in_train} tokens "
            f"(round {config.sequence_length_round_in_train})"
        )
    return "; ".join(parts)


# The trainer logs these per step (means over the step's passes) when a pass is packed by token budget.
_PASSES = ("train", "old", "ref")


class StepReporter(TrainerCallback):
    """Prints one line per optimizer step: step, generation iteration, curriculum stage, mean reward, and the
    packed passes' micro-batch counts and padding ratios (computed tokens ÷ real tokens) when the trainer logs them.
    """

    def __init__(self, dataset: RemoteRLDataset, *, is_main: bool = True) -> None:
        self.dataset = dataset
        self.is_main = is_main
        self.steps: list[dict[str, Any]] = []
        self._started = time.perf_counter()
        self._generation: tuple[int, float] | None = None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
        if not logs:
            return
        if "reward" in logs:
            self._generation = (int(logs.get("proctor/iteration", -1)), logs["reward"])
        elif "loss" not in logs or self._generation is None:
            return  # not a training step's log (e.g. the run's summary)
        # A step that generated nothing trains on the rows of the latest generation: its iteration and reward.
        iteration, reward = self._generation
        entry: dict[str, Any] = {
            "step": state.global_step,
            "iteration": iteration,
            "stage": self.dataset.stage_of(iteration),
            "reward": reward,
        }
        batching = []
        for kind in _PASSES:
            count, padding = logs.get(f"batching/{kind}_micro_batches"), logs.get(f"batching/{kind}_padding_ratio")
            if count is None or padding is None:
                continue
            entry[f"{kind}_micro_batches"] = count
            entry[f"{kind}_padding_ratio"] = padding
            if kind == "train":
                batching.append(f"micro-batches {_count(count)} padding {padding:.2f}")
            else:
                batching.append(f"{kind} {_count(count)}×{padding:.2f}")
        self.steps.append(entry)
        if self.is_main:
            figures = "".join(f"  {b}" for b in batching)
            print(
                f"step {entry['step']:>4}  iteration {iteration:>4}  stage {entry['stage']:<12} "
                f"reward {entry['reward']:.3f}{figures}  ({time.perf_counter() - self._started:.0f}s)",
                flush=True,
            )


def _count(value: float) -> str:
    """A logged micro-batch count: a mean over the step's passes, so whole unless they differed."""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
