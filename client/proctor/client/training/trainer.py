"""``ProctorGRPOConfig`` / ``ProctorGRPOTrainer``: rollout batching inside TRL's ``GRPOTrainer``.

The only module that touches TRL's private methods (pinned to the 1.16 line, whose call graph is
``_prepare_inputs`` → ``_generate_and_score_completions`` → ``_generate`` → ``_generate_single_turn``, then the
old-policy and reference passes through ``_get_per_token_logps_and_entropies``; and ``compute_loss`` →
``_compute_loss`` → ``_get_per_token_logps_and_entropies`` for the training pass):

- ``_generate_single_turn`` runs generation in chunks of ``rollout_micro_batch_size`` rows;
- ``_get_per_token_logps_and_entropies`` runs the old-policy and reference log-prob passes in chunks of their
  own sizes, or packed by token budget (``use_dynamic_batching_in_infer``);
- ``compute_loss`` runs the training pass forward and backward per token-budget micro-batch
  (``use_dynamic_batching_in_train``), balanced across processes, each micro-batch's loss scaled by its share;
- ``_save_checkpoint`` / ``_load_rng_state`` keep a generation's rows across a checkpoint taken in its middle.

All sizes count rows, i.e. (prompt, completion) pairs, like ``per_device_train_batch_size``. TRL gathers
``steps_per_generation`` micro-steps into one local generation batch of ``per_device_train_batch_size ×
steps_per_generation`` rows, which must be a multiple of the service batch ``lcm(rollout, ref, old)`` for every
pass to cut it into whole chunks; left unset, ``steps_per_generation`` is derived to make it so
(:func:`proctor.batching.vocabulary.derive_generation_sizes`).

Packed micro-batches run padding-free (rows back to back, position ids restarting) where the model's attention
keeps packed sequences apart (:mod:`proctor.client.training.packing`), and otherwise as ``rows × width``
rectangles, each row's real tokens right-aligned; either way within the token budget, the per-token results
scattered back into the ``(batch, completion_length)`` layout TRL expects. Results equal stock TRL's within
floating-point noise (RoPE is shift-invariant; measured ≤ 1e-5 in fp32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

from proctor.batching.dynamic import plan_dynamic_batches
from proctor.batching.lcm import chunk_slices
from proctor.batching.vocabulary import GenerationSizes, derive_generation_sizes
from proctor.client.rewards import GraderReward, RemoteReward
from proctor.client.training.packing import keeps_packed_sequences_apart

__all__ = ["BatchingLog", "LogpsCall", "ProctorGRPOConfig", "ProctorGRPOTrainer"]

_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)

# Loss types whose loss is a sum over rows divided by a normaliser fixed before the pass (see _share).
_ROW_MEAN_LOSSES = frozenset({"grpo", "sapo", "luspo", "dr_grpo"})
_TOKEN_MEAN_LOSSES = frozenset({"bnpo"})
_GLOBAL_NORMALISED_LOSSES = frozenset({"cispo", "dapo", "vespo"})
_PER_MICRO_LOSS_TYPES = _ROW_MEAN_LOSSES | _TOKEN_MEAN_LOSSES | _GLOBAL_NORMALISED_LOSSES


@dataclass
class ProctorGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus rollout batching. Sizes count rows ((prompt, completion) pairs) on one device."""

    rollout_micro_batch_size: int | None = field(
        default=None, metadata={"help": "Rows per generate call; default: the whole local generation batch."}
    )
    ref_logps_micro_batch_size: int | None = field(
        default=None, metadata={"help": "Rows per reference log-prob forward; default per_device_train_batch_size."}
    )
    old_logps_micro_batch_size: int | None = field(
        default=None, metadata={"help": "Rows per old-policy log-prob forward; default per_device_train_batch_size."}
    )
    use_dynamic_batching_in_infer: bool = field(
        default=False, metadata={"help": "Pack the old/ref log-prob passes by token budget instead of row counts."}
    )
    max_tokens_per_microbatch_in_infer: int | None = field(
        default=None, metadata={"help": "Token budget (rows × padded length) of an old/ref log-prob micro-batch."}
    )
    sequence_length_round_in_infer: int = field(
        default=1, metadata={"help": "Pad each log-prob micro-batch's length to a multiple of this."}
    )
    use_dynamic_batching_in_train: bool = field(
        default=False, metadata={"help": "Pack the training forward/backward by token budget."}
    )
    max_tokens_per_microbatch_in_train: int | None = field(
        default=None, metadata={"help": "Token budget (rows × padded length) of a training micro-batch."}
    )
    sequence_length_round_in_train: int = field(
        default=1, metadata={"help": "Pad each training micro-batch's length to a multiple of this."}
    )
    balance_ranks_by_tokens: bool = field(
        default=True,
        metadata={
            "help": "With dynamic batching in training on several processes, redistribute each micro-step's rows "
            "across processes by token count, so no process waits for a heavier one at the gradient all-reduce."
        },
    )
    padding_free: str = field(
        default="auto",
        metadata={
            "help": "'auto': pack the rows of a token-budget micro-batch back to back with no padding where the "
            "model's attention keeps packed sequences apart (checked on the model, once); 'off': always padded "
            "rectangles."
        },
    )

    def __post_init__(self) -> None:
        derive_steps = self.steps_per_generation is None and self.generation_batch_size is None
        super().__post_init__()
        for phase in ("infer", "train"):
            if getattr(self, f"use_dynamic_batching_in_{phase}"):
                cap = getattr(self, f"max_tokens_per_microbatch_in_{phase}")
                if cap is None or cap < 1:
                    raise ValueError(
                        f"use_dynamic_batching_in_{phase}=True needs max_tokens_per_microbatch_in_{phase} ≥ 1 "
                        f"(got {cap}): set the token budget of one {phase} micro-batch"
                    )
            if getattr(self, f"sequence_length_round_in_{phase}") < 1:
                raise ValueError(f"sequence_length_round_in_{phase} must be at least 1")
        if self.padding_free not in ("auto", "off"):
            raise ValueError(f"padding_free must be 'auto' or 'off', got {self.padding_free!r}")
        if self.use_dynamic_batching_in_train:
            self._check_per_micro_training()
        assert self.steps_per_generation is not None  # resolved by GRPOConfig.__post_init__
        sizes = derive_generation_sizes(
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_generations=self.num_generations or 1,
            dp_size=self.world_size,
            steps_per_generation=None if derive_steps else self.steps_per_generation,
            rollout_micro_batch_size=self.rollout_micro_batch_size,
            ref_logps_micro_batch_size=self.ref_logps_micro_batch_size,
            old_logps_micro_batch_size=self.old_logps_micro_batch_size,
        )
        self.steps_per_generation = sizes.steps_per_generation
        self.generation_batch_size = sizes.generation_batch_size
        self._batch_sizes = sizes

    def _check_per_micro_training(self) -> None:
        # The training pass runs forward and backward per micro-batch, each loss scaled by its share of the
        # micro-step. That is exact when the loss is a sum over rows with normalisers known up front; these
        # settings need the whole micro-step's entropies or a per-process token count first.
        if self.loss_type not in _PER_MICRO_LOSS_TYPES:
            raise ValueError(
                f"use_dynamic_batching_in_train does not know how to split loss_type={self.loss_type!r} into "
                f"micro-batches (it knows {', '.join(sorted(_PER_MICRO_LOSS_TYPES))}): pick one of those, or turn "
                "dynamic batching in training off"
            )
        whole_step = "it needs the whole micro-step's entropies before any backward: turn it off, or set "
        whole_step += "use_dynamic_batching_in_train=False"
        if self.top_entropy_quantile < 1.0:
            raise ValueError(f"use_dynamic_batching_in_train does not support top_entropy_quantile < 1: {whole_step}")
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            raise ValueError(
                "use_dynamic_batching_in_train does not support an entropy bonus (entropy_coef or "
                f"use_adaptive_entropy): {whole_step}"
            )
        if self.loss_type == "bnpo" and self.balance_ranks_by_tokens and self.world_size > 1:
            raise ValueError(
                "use_dynamic_batching_in_train does not support bnpo with balance_ranks_by_tokens on several "
                "processes: bnpo normalises by each process's own token count, so a row cannot move to another "
                "process without changing the gradient: set balance_ranks_by_tokens=False, or use "
                "loss_type='dapo' (normalised by the global token count)"
            )

    @property
    def batch_sizes(self) -> GenerationSizes:
        """The derived sizes (rows per micro-step, update and generation; the service batch)."""
        return self._batch_sizes

    @property
    def service_target_bs(self) -> int:
        """``lcm`` of the rollout, reference and old-policy micro-batch sizes that are set (1 if none is)."""
        return self.batch_sizes.service_batch_size


class LogpsCall(NamedTuple):
    """One forward of a log-prob pass (``kind``: ``old``, ``ref`` or ``train``)."""

    kind: str
    rows: int
    width: int
    """The padded width of a ``rows × width`` rectangle, or the length of the one packed sequence."""
    packed: bool = False
    """Whether the rows ran back to back in one sequence, with no padding."""


@dataclass
class BatchingLog:
    """What the batching did, for tests and metrics: one entry per forward (or generate) call.

    Only the latest ``limit`` entries of each list are kept, so a long run does not grow it without bound.
    """

    limit: int = 10_000
    generate_rows: list[int] = field(default_factory=list)
    logps_calls: list[LogpsCall] = field(default_factory=list)

    def record_generate(self, rows: int) -> None:
        self.generate_rows.append(rows)
        del self.generate_rows[: -self.limit]

    def record_logps(self, kind: str, rows: int, width: int, packed: bool = False) -> None:
        self.logps_calls.append(LogpsCall(kind, rows, width, packed))
        del self.logps_calls[: -self.limit]


class ProctorGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with chunked generation, chunked or token-budget-packed log-prob passes, and a training
    pass that runs forward and backward per token-budget micro-batch, balanced across processes.

    Takes a :class:`ProctorGRPOConfig`; with a plain ``GRPOConfig`` it behaves like ``GRPOTrainer``, except that
    a run resumed from a checkpoint taken in the middle of a generation continues on the first run's schedule.
    Works with any ``datasets.Dataset``, a :class:`~proctor.client.RemoteRLDataset` included.
    """

    def __init__(self, *args: Any, refill_rounds: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refill_rounds = refill_rounds
        self._refill_reward = self._check_refill(refill_rounds)
        self.batching_log = BatchingLog()
        self._rollout_inputs: list[dict[str, Any]] | None = None
        self._packs_sequences: dict[int, bool] = {}
        self._one_micro_batch = False  # set while the training pass runs one planned micro-batch
        config = self.args
        if isinstance(config, ProctorGRPOConfig) and config.use_dynamic_batching_in_train:
            if self.aux_loss_enabled:
                raise ValueError(
                    "use_dynamic_batching_in_train does not support a router auxiliary loss (a mixture-of-experts "
                    "model with router_aux_loss_coef ≠ 0): set router_aux_loss_coef=0 or turn dynamic batching in "
                    "training off"
                )
            if self.accelerator.distributed_type == "DEEPSPEED":  # a str enum
                raise ValueError(
                    "use_dynamic_batching_in_train runs several backward passes per micro-step, which DeepSpeed's "
                    "engine does not accept: use DDP or FSDP, or turn dynamic batching in training off"
                )

    # --- generation -----------------------------------------------------------------------------------------

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: Any,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], Any]:
        size = getattr(self.args, "rollout_micro_batch_size", None)
        if size is None or self.use_vllm or images is not None or multimodal_fields or len(prompt_ids) <= size:
            # vLLM batches internally; multimodal rows carry per-row side inputs the chunks would have to slice.
            if size is not None:
                self.batching_log.record_generate(len(prompt_ids))
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        completion_ids: list[list[int]] = []
        logprobs: list[Any] | None = []
        for part in chunk_slices(len(prompt_ids), size):
            self.batching_log.record_generate(part.stop - part.start)
            ids, lps = super()._generate_single_turn(
                prompt_ids[part], None, multimodal_fields, num_generations, has_tool_images
            )
            completion_ids.extend(ids)
            logprobs = None if lps is None or logprobs is None else [*logprobs, *lps]
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._rollout_inputs = inputs
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._rollout_inputs = None

    def _generate(self, prompts: list[Any]) -> Any:
        out = super()._generate(prompts)
        # The completions go to the dataserver's graders now, so that grading overlaps the log-prob passes
        # TRL runs before it asks for the rewards.
        inputs = self._rollout_inputs
        if inputs is not None and len(inputs) == len(prompts):
            completion_ids, completions = out[1], out[3]
            for reward in _remote_rewards(self.reward_funcs):
                reward.post(inputs, completions, completion_ids)
            if self._refill_reward is not None and self.model is not None and self.model.training:
                out = self._refill(self._refill_reward, inputs, prompts, out)
        return out

    # --- group refill ---------------------------------------------------------------------------------------

    def _check_refill(self, rounds: int) -> RemoteReward | None:
        """The reward function refill rounds grade through; None when the run refills nothing."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"refill_rounds must be a whole number of rounds, 0 or more, got {rounds!r}")
        if rounds == 0:
            return None
        remote = [r for r in _remote_rewards(self.reward_funcs) if r.dataset is not None]
        if not remote:
            raise ValueError(
                "refill_rounds asks the dataserver which graded groups to replace, so a reward function must grade "
                "there: pass reward_funcs=remote_reward(client, dataset=dataset), dataset being the run's "
                "RemoteRLDataset"
            )
        if self.use_vllm or self.rollout_func is not None or self.tools:
            raise ValueError(
                "refill_rounds generates the replaced groups' rows again with the model's own generate; it does "
                "not drive vLLM, a rollout_func or tools: set refill_rounds=0 for such a run"
            )
        return remote[0]

    def _refill(
        self, reward: RemoteReward, inputs: list[dict[str, Any]], prompts: list[Any], out: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """Replace the step's groups the server's refill rule does not keep, round by round, and generate only
        their rows again. ``inputs`` and ``prompts`` are TRL's, changed in place (its rewards and log-prob
        passes read them afterwards); returns ``out`` (``_generate``'s result) with the new rows spliced in."""
        assert reward.dataset is not None
        steps = {int(row["iteration"]) for row in inputs}
        if len(steps) != 1 or "image" in inputs[0] or "images" in inputs[0]:
            return out  # a generation batch of a RemoteRLDataset is one step, with text prompts
        step = steps.pop()
        rows = [list(part) if isinstance(part, list) else part for part in out]
        completion_ids, completions = rows[1], rows[3]
        allowed = min(self.refill_rounds, reward.dataset.refill_rounds(step))
        fresh = list(range(len(inputs)))  # the rows generated last, which the next round reads the grades of
        rounds = replaced = 0
        for round_ in range(1, allowed + 1):
            _grade(
                reward, [inputs[j] for j in fresh], [completions[j] for j in fresh], [completion_ids[j] for j in fresh]
            )
            self.accelerator.wait_for_everyone()  # every process's rows are graded before the server decides
            answer = reward.client.refill(step, round_, self.num_generations or 1)
            if not answer.replacements:
                break
            rounds, replaced = round_, replaced + len(answer.replacements)
            by_slot = {r.replaces: r.sample for r in answer.replacements}
            fresh = [j for j, row in enumerate(inputs) if int(row["slot"]) in by_slot]
            for j in fresh:
                inputs[j].update(reward.dataset.row(by_slot[int(inputs[j]["slot"])], inputs[j]))
                prompts[j] = inputs[j]["prompt"]
            # Generation is collective (TRL gathers its metrics; sharded weights): every process generates as
            # many rows as the process with the most replaced rows, padded with copies of its own first row.
            count = torch.tensor([len(fresh)], device=self.accelerator.device)
            most = int(self.accelerator.gather(count).max().item())
            padded = fresh + [fresh[0] if fresh else 0] * (most - len(fresh))
            again = [
                part[: len(fresh)] if isinstance(part, list) else part
                for part in super()._generate([prompts[j] for j in padded])
            ]
            if not fresh:
                continue
            for n, j in enumerate(fresh):
                for part, new in zip(rows, again, strict=True):
                    if isinstance(part, list) and isinstance(new, list) and len(new) == len(fresh):
                        part[j] = new[n]
            reward.post([inputs[j] for j in fresh], [completions[j] for j in fresh], [completion_ids[j] for j in fresh])
        self._metrics["train"]["proctor/refill_rounds"].append(float(rounds))
        self._metrics["train"]["proctor/refilled_groups"].append(float(replaced))
        return tuple(rows)

    # --- log-prob passes ------------------------------------------------------------------------------------

    def _pass_kind(self, model: Any) -> str:
        """``ref`` when the weights about to run are the reference model's, else ``old`` (the policy's).

        Read from the model itself: the reference model, or, when a PEFT policy stands in for it, the adapter
        state TRL sets for the reference pass (adapters disabled, or the ``ref`` adapter active).
        """
        if self.ref_model is not None and model is self.ref_model:
            return "ref"
        return "ref" if _reference_adapter_active(self.accelerator.unwrap_model(model)) else "old"

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        args = self.args
        text_only = all(multimodal.get(k) is None for k in _MULTIMODAL)
        if not isinstance(args, ProctorGRPOConfig) or not text_only:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        training_pass = compute_entropy  # only _compute_loss asks for entropies; old/ref passes never do
        if training_pass:
            if self._one_micro_batch:
                rows = torch.arange(input_ids.size(0), device=input_ids.device)
                layout = _Layout.of(attention_mask, logits_to_keep)
                width = _round_up(int(layout.lengths.max()), args.sequence_length_round_in_train)
                logps, entropies = self._forward_rows(
                    "train", model, input_ids, layout, rows, width, args.sequence_length_round_in_train, True
                )
                return logps, entropies, None
            if args.use_dynamic_batching_in_train and not compute_aux_loss:
                return self._packed(
                    "train", model, input_ids, attention_mask, logits_to_keep,
                    args.max_tokens_per_microbatch_in_train, args.sequence_length_round_in_train, compute_entropy,
                )  # fmt: skip
            return self._chunked(
                "train", model, input_ids, attention_mask, logits_to_keep, None, compute_entropy, compute_aux_loss
            )
        kind = self._pass_kind(model)
        if args.use_dynamic_batching_in_infer:
            return self._packed(
                kind, model, input_ids, attention_mask, logits_to_keep,
                args.max_tokens_per_microbatch_in_infer, args.sequence_length_round_in_infer, False,
            )  # fmt: skip
        size = args.ref_logps_micro_batch_size if kind == "ref" else args.old_logps_micro_batch_size
        return self._chunked(
            kind, model, input_ids, attention_mask, logits_to_keep, size or batch_size, False, compute_aux_loss
        )

    def _chunked(
        self,
        kind: str,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Stock TRL's pass, one forward per chunk of ``size`` rows (all rows when ``size`` is None)."""
        logps, entropies, aux = [], [], []
        for part in chunk_slices(input_ids.size(0), size or input_ids.size(0)):
            self.batching_log.record_logps(kind, part.stop - part.start, input_ids.size(1))
            lp, ent, ax = super()._get_per_token_logps_and_entropies(
                model, input_ids[part], attention_mask[part], logits_to_keep,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
            )  # fmt: skip
            logps.append(lp)
            if ent is not None:
                entropies.append(ent)
            if ax is not None:
                aux.append(ax)
        return (
            torch.cat(logps),
            torch.cat(entropies) if entropies else None,
            torch.stack(aux).mean() if aux else None,
        )

    def _packed(
        self,
        kind: str,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        budget: int | None,
        round_to: int,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """The pass packed by token budget: micro-batches of similar real lengths, each within ``budget``;
        results scattered back to stock TRL's ``(batch, logits_to_keep)`` layout."""
        assert budget is not None  # ProctorGRPOConfig refuses dynamic batching without a budget
        layout = _Layout.of(attention_mask, logits_to_keep)
        lengths = layout.lengths.tolist()  # one copy to the host, for the plan and the metrics
        plan = plan_dynamic_batches(lengths, max_tokens_per_microbatch=budget, sequence_length_round=round_to)
        device = input_ids.device
        placed: list[torch.Tensor] = []
        logp_parts: list[torch.Tensor] = []
        entropy_parts: list[torch.Tensor] = []
        for micro in plan.ranks[0]:
            index = torch.tensor(micro.indices, device=device)
            logps, entropies = self._forward_rows(
                kind, model, input_ids, layout, index, micro.padded_len, round_to, compute_entropy
            )
            placed.append(index)
            logp_parts.append(logps)
            if entropies is not None:
                entropy_parts.append(entropies)
        self._log_plan(kind, [micro.indices for micro in plan.ranks[0]], lengths, round_to, model)
        shape = (input_ids.size(0), logits_to_keep)
        order = (torch.cat(placed),)
        logps = _scatter(shape, order, logp_parts)
        return logps, _scatter(shape, order, entropy_parts) if compute_entropy else None, None

    def _forward_rows(
        self,
        kind: str,
        model: Any,
        input_ids: torch.Tensor,
        layout: _Layout,
        index: torch.Tensor,
        width: int,
        round_to: int,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over the rows ``index``: their log-probs and entropies in TRL's ``(rows, logits_to_keep)``
        layout, zero past each row's completion."""
        device = input_ids.device
        keep = torch.arange(layout.logits_to_keep, device=device)[None, :]
        # The model scores positions 1.. of a row; a micro-batch of one-token rows (a one-token prompt whose
        # completion is masked away) would leave nothing to gather from, so it is never narrower than 2.
        width = max(width, 2)
        p, c = layout.prompt_lens[index, None], layout.completion_lens[index, None]
        col = torch.arange(width, device=device)[None, :]
        # Each row's real tokens, contiguous and right-aligned: [pads][prompt][completion].
        real = col >= width - p - c
        source = (col - width + c + layout.prompt_cols).clamp(0, input_ids.size(1) - 1)
        ids = input_ids[index].gather(1, source).masked_fill(~real, self._tokenizer.pad_token_id)
        labels = ids.masked_fill(col < width - c, -100)
        beyond = keep >= c
        if self._padding_free(model):
            # The rows back to back in one sequence, position ids restarting at each row.
            flat = torch.zeros_like(ids)
            count = int(real.sum())
            flat[real] = torch.arange(count, device=device)
            length = max(_round_up(count, round_to), 2)
            tail = length - count  # rounding pads: a sequence of their own, scored by nobody
            positions = (col - (width - p - c)).expand_as(ids)[real]
            with self.accelerator.autocast():
                outputs = model(
                    input_ids=torch.cat([ids[real], ids.new_full((tail,), self._tokenizer.pad_token_id)])[None],
                    position_ids=torch.cat([positions, torch.arange(tail, device=device)])[None],
                    labels=torch.cat([labels[real], labels.new_full((tail,), -100)])[None],
                    fused_lm_head=True,
                )
            # log_probs[0, j] scores token j + 1: completion token k sits at column width - c + k of the row's
            # rectangle, at flat position flat[row, width - c + k], scored at that position - 1.
            scored = (flat.gather(1, (width - c + keep).clamp(max=width - 1)) - 1).clamp(min=0)
            self.batching_log.record_logps(kind, int(index.numel()), length, True)
            logps = outputs.log_probs[0][scored].masked_fill(beyond, 0)
            entropies = outputs.entropy[0][scored].masked_fill(beyond, 0) if compute_entropy else None
            return logps, entropies
        self.batching_log.record_logps(kind, int(index.numel()), width)
        with self.accelerator.autocast():
            outputs = model(input_ids=ids, attention_mask=real.to(layout.mask_dtype), labels=labels, fused_lm_head=True)
        # log_probs[:, j] scores token j + 1, so completion token k (at column width - c + k) is at column
        # width - c - 1 + k: the last c columns, moved to the front as in TRL's (batch, logits_to_keep).
        scored = (width - 1 - c + keep).clamp(0, width - 2)
        logps = outputs.log_probs.gather(1, scored).masked_fill(beyond, 0)
        entropies = outputs.entropy.gather(1, scored).masked_fill(beyond, 0) if compute_entropy else None
        return logps, entropies

    def _padding_free(self, model: Any) -> bool:
        """Whether micro-batches of ``model`` run padding-free: asked for, and checked once on the model."""
        args = self.args
        if not isinstance(args, ProctorGRPOConfig) or args.padding_free == "off":
            return False
        unwrapped = self.accelerator.unwrap_model(model)
        key = id(unwrapped)
        if key not in self._packs_sequences:
            # The forward goes through the wrapper (DDP, FSDP), which knows how to run its shards.
            with self.accelerator.autocast():
                self._packs_sequences[key] = keeps_packed_sequences_apart(model, config=unwrapped.config)
        return self._packs_sequences[key]

    def _log_plan(
        self, kind: str, micros: Sequence[Sequence[int]], lengths: Sequence[int], round_to: int, model: Any
    ) -> None:
        """Micro-batches and padding ratio (computed ÷ real tokens) of one pass, into the step's metrics."""
        sizes = [[lengths[i] for i in micro] for micro in micros]
        real = sum(map(sum, sizes))
        if self._padding_free(model):
            computed = sum(max(_round_up(sum(s), round_to), 2) for s in sizes)
        else:
            computed = sum(len(s) * max(_round_up(max(s), round_to), 2) for s in sizes)
        metrics = self._metrics["train" if getattr(self.model, "training", False) else "eval"]
        metrics[f"batching/{kind}_micro_batches"].append(float(len(micros)))
        metrics[f"batching/{kind}_padding_ratio"].append(computed / max(real, 1))

    # --- training pass --------------------------------------------------------------------------------------

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        args = self.args
        per_micro = (
            isinstance(args, ProctorGRPOConfig)
            and args.use_dynamic_batching_in_train
            and not return_outputs
            and model.training
            and torch.is_grad_enabled()
            and all(inputs.get(k) is None for k in _MULTIMODAL)
        )
        if not per_micro:
            loss: torch.Tensor = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss
        return self._train_per_micro_batch(model, inputs)

    def _train_per_micro_batch(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """The micro-step's loss, forward and backward per token-budget micro-batch.

        Every micro-batch but the last runs its backward here (without the gradient all-reduce); the last one's
        loss is returned, with the others' values added as constants, for the Trainer's own backward. Each
        partial loss is TRL's loss of its rows scaled by their share of the micro-step (:func:`_share`), so the
        accumulated gradient is the whole micro-step's.
        """
        args = self.args
        assert isinstance(args, ProctorGRPOConfig) and args.max_tokens_per_microbatch_in_train is not None
        rows = inputs["completion_mask"].size(0)
        world = self.accelerator.num_processes
        balance = world > 1 and args.balance_ranks_by_tokens
        batch = _gather_rows(self.accelerator, inputs, rows) if balance else inputs
        masks = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        layout = _Layout.of(masks, batch["completion_mask"].size(1))
        lengths = layout.lengths.clamp(min=1).tolist()
        budget, round_to = args.max_tokens_per_microbatch_in_train, args.sequence_length_round_in_train
        plan = plan_dynamic_batches(
            lengths, max_tokens_per_microbatch=budget, sequence_length_round=round_to, dp_size=world if balance else 1
        )
        micros = [micro.indices for micro in plan.ranks[self.accelerator.process_index if balance else 0]]
        if world > 1 and not balance:
            micros = self._same_count_on_every_process(micros)
        self._log_plan("train", micros, lengths, round_to, model)
        if balance:
            # The heaviest process sets the step's pace: its computed tokens with and without the rebalancing.
            own = [
                plan_dynamic_batches(lengths[r * rows : (r + 1) * rows], max_tokens_per_microbatch=budget,
                                     sequence_length_round=round_to).computed_tokens
                for r in range(world)
            ]  # fmt: skip
            self._metrics["train"]["batching/heaviest_rank_tokens"].append(float(max(plan.rank_loads)))
            self._metrics["train"]["batching/heaviest_rank_tokens_unbalanced"].append(float(max(own)))
        local_tokens = _loss_mask(inputs).sum()
        sizes = self._rows_on_every_process(micros) if world > 1 else [len(micro) for micro in micros]
        earlier: torch.Tensor | None = None
        for position, (micro, size) in enumerate(zip(micros, sizes, strict=True)):
            part = _with_empty_rows(_take_rows(batch, micro, layout.rows), len(micro), size - len(micro))
            share = _share(self.loss_type, part, size, rows, local_tokens)
            last = position == len(micros) - 1
            # The all-reduce runs once, on the last backward, over the gradients accumulated before it.
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                self._one_micro_batch = True
                try:
                    loss = self._compute_loss(model, part) * share
                finally:
                    self._one_micro_batch = False
                if last:
                    return loss if earlier is None else loss + earlier
                self.accelerator.backward(loss)
            earlier = loss.detach() if earlier is None else earlier + loss.detach()
        raise AssertionError("a plan has at least one micro-batch")

    def _rows_on_every_process(self, micros: list[tuple[int, ...]]) -> list[int]:
        """Rows each micro-batch runs with on every process: the most any process has at that position.

        TRL's loss gathers per-row metrics across processes, which needs equal row counts; a process with fewer
        rows fills up with empty rows (one pad token, nothing to score, no advantage), which add nothing.
        """
        counts = self.accelerator.gather(torch.tensor([len(m) for m in micros], device=self.accelerator.device))
        most: list[int] = counts.view(-1, len(micros)).max(0).values.tolist()
        return most

    def _same_count_on_every_process(self, micros: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Split the largest micro-batches in two until this process has as many as the busiest one.

        TRL's loss gathers metrics across processes once per micro-batch, so every process must run the same
        number. Halves stay within the budget; every process has the same rows, so there is always one to split.
        """
        counts = self.accelerator.gather(torch.tensor([len(micros)], device=self.accelerator.device))
        most = int(counts.max())
        micros = list(micros)
        while len(micros) < most:
            largest = max(range(len(micros)), key=lambda k: len(micros[k]))
            rows = micros[largest]
            half = len(rows) // 2
            micros[largest : largest + 1] = [rows[:half], rows[half:]]
        return micros

    # --- resuming -------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        args: Any = self.args
        generate_every = args.steps_per_generation * self.num_iterations
        if self._buffered_inputs is None or self._step % generate_every == 0:
            return  # at a generation boundary: a resumed run generates next, as this one would
        # In the middle of a generation: keep the generation's rows, so that a resumed run trains the remaining
        # micro-steps on them, as this run will.
        folder = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        torch.save(
            {"step": self._step, "buffer": self._buffered_inputs},
            folder / _ROLLOUT_BUFFER.format(process=self.accelerator.process_index),
        )

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        # TRL counts micro-steps from 0 in every run, so a run resumed mid-generation would generate at once and
        # shift the schedule of generations by the micro-steps already trained; continue the first run's count.
        self._step = self.state.global_step * self.args.gradient_accumulation_steps
        saved = Path(checkpoint, _ROLLOUT_BUFFER.format(process=self.accelerator.process_index))
        if saved.exists():
            state = torch.load(saved, map_location=self.accelerator.device, weights_only=True)
            if state["step"] == self._step:
                self._buffered_inputs = state["buffer"]


_ROLLOUT_BUFFER = "proctor-rollout-buffer-{process}.pt"


@dataclass(frozen=True, slots=True)
class _Layout:
    """TRL's batch layout: prompts left-padded to ``prompt_cols``, then completions right-padded."""

    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    prompt_cols: int
    logits_to_keep: int
    mask_dtype: torch.dtype

    @classmethod
    def of(cls, attention_mask: torch.Tensor, logits_to_keep: int) -> _Layout:
        prompt_cols = attention_mask.size(1) - logits_to_keep
        return cls(
            attention_mask[:, :prompt_cols].sum(1),
            attention_mask[:, prompt_cols:].sum(1),
            prompt_cols,
            logits_to_keep,
            attention_mask.dtype,
        )

    @property
    def lengths(self) -> torch.Tensor:
        return self.prompt_lens + self.completion_lens

    @property
    def rows(self) -> int:
        return int(self.prompt_lens.numel())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    mask: torch.Tensor = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def _share(
    loss_type: str, part: dict[str, Any], part_rows: int, rows: int, tokens: torch.Tensor
) -> float | torch.Tensor:
    """The factor that turns TRL's loss of ``part`` (its rows alone) into their term of the micro-step's loss.

    Row-mean losses divide by the micro-step's rows (``grpo``, ``sapo``, ``luspo``; ``dr_grpo`` by rows × the
    completion limit), ``bnpo`` by the process's own loss tokens, and ``cispo``, ``dapo`` and ``vespo`` by the
    global token count TRL passes in, which is the same for every part.
    """
    if loss_type in _ROW_MEAN_LOSSES:
        return part_rows / rows
    if loss_type in _TOKEN_MEAN_LOSSES:
        return _loss_mask(part).sum().clamp(min=1) / tokens.clamp(min=1)  # a tensor: no wait for the device
    if loss_type in _GLOBAL_NORMALISED_LOSSES:
        return 1.0
    raise ValueError(f"loss_type {loss_type!r} has no per-micro-batch scaling")  # the config refuses it first


def _row_tensor(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == rows


def _take_rows(batch: dict[str, Any], rows: Sequence[int], total: int) -> dict[str, Any]:
    """The rows ``rows`` of every per-row tensor of ``batch``; everything else (e.g. ``num_items_in_batch``) as is."""
    if not batch:
        return {}
    device = batch["completion_mask"].device
    index = torch.tensor(list(rows), device=device)
    return {key: value[index] if _row_tensor(value, total) else value for key, value in batch.items()}


def _with_empty_rows(part: dict[str, Any], rows: int, extra: int) -> dict[str, Any]:
    """``part`` with ``extra`` rows that add nothing to the loss: all zeros (no completion, no advantage, log-probs
    and ratios neutral) but for one prompt token, so that no row is empty for the attention."""
    if extra == 0:
        return part
    padded: dict[str, Any] = {}
    for key, value in part.items():
        if not _row_tensor(value, rows):
            padded[key] = value
            continue
        empty = value.new_zeros((extra, *value.shape[1:]))
        if key == "prompt_mask":
            empty[:, -1] = 1
        elif key == "importance_sampling_ratio":
            empty += 1
        padded[key] = torch.cat([value, empty])
    return padded


def _gather_rows(accelerator: Any, inputs: dict[str, Any], rows: int) -> dict[str, Any]:
    """Every process's rows of the micro-step, in process order, widths padded to the widest process's.

    Prompt columns are padded on the left and the others on the right, keeping TRL's layout.
    """
    gathered: dict[str, Any] = {}
    for key, value in inputs.items():
        if not _row_tensor(value, rows):
            gathered[key] = value
            continue
        tensor = value.to(torch.uint8) if value.dtype == torch.bool else value
        if tensor.dim() >= 2:
            tensor = accelerator.pad_across_processes(tensor, dim=1, pad_index=0, pad_first=key.startswith("prompt_"))
        tensor = accelerator.gather(tensor)
        gathered[key] = tensor.to(torch.bool) if value.dtype == torch.bool else tensor
    return gathered


def _remote_rewards(funcs: Sequence[Any]) -> list[RemoteReward]:
    """The dataserver rewards behind a trainer's reward functions, each once (the components of
    ``remote_reward(components=True)`` share one)."""
    out: list[RemoteReward] = []
    for func in funcs:
        reward = func.shared if isinstance(func, GraderReward) else func
        if isinstance(reward, RemoteReward) and all(reward is not seen for seen in out):
            out.append(reward)
    return out


def _grade(
    reward: RemoteReward, rows: Sequence[dict[str, Any]], completions: Sequence[Any], completion_ids: Sequence[Any]
) -> None:
    """Have the dataserver grade ``rows``' completions, and wait until it has."""
    if rows:
        reward(
            [row["prompt"] for row in rows],
            completions,
            completion_ids,
            sample_id=[row["sample_id"] for row in rows],
            slot=[row["slot"] for row in rows],
            completion_index=[row["completion_index"] for row in rows],
            iteration=[row["iteration"] for row in rows],
        )


def _reference_adapter_active(model: Any) -> bool:
    """Whether a PEFT model is set up as TRL sets it for the reference pass: adapters off, or ``ref`` active."""
    if not getattr(model, "peft_config", None):
        return False
    if getattr(model, "active_adapter", None) == "ref":
        return True
    from peft.tuners.tuners_utils import BaseTunerLayer  # a PEFT model: peft is installed

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            return bool(module.disable_adapters)  # PEFT switches every tuner layer together
    return False


def _scatter(shape: tuple[int, int], rows: tuple[torch.Tensor], parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Micro-batch rows back to their places in a zero ``shape`` tensor, out of place so gradients flow."""
    values = torch.cat(list(parts))
    return values.new_zeros(shape).index_put(rows, values)
