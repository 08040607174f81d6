"""``ProctorGRPOConfig`` / ``ProctorGRPOTrainer``: rollout batching inside TRL's ``GRPOTrainer``.

The only module that touches TRL's private methods (pinned to the 1.16 line, whose call graph is
``_prepare_inputs`` → ``_generate_and_score_completions`` → ``_generate`` → ``_generate_single_turn``, then the
old-policy and reference passes through ``_get_per_token_logps_and_entropies``; and ``compute_loss`` →
``_compute_loss`` → ``_get_per_token_logps_and_entropies`` for the training pass):

- ``_generate_single_turn`` runs generation in chunks of ``rollout_micro_batch_size`` rows;
- ``_get_per_token_logps_and_entropies`` runs the old-policy and reference log-prob passes in chunks of their
  own sizes, or packed by token budget (``use_dynamic_batching_in_infer``), and the training pass packed by
  token budget (``use_dynamic_batching_in_train``).

All sizes count rows, i.e. (prompt, completion) pairs, like ``per_device_train_batch_size``. TRL already
aggregates ``steps_per_generation`` micro-batches into one local generation batch of
``per_device_train_batch_size × steps_per_generation`` rows; that is the LCM aggregator's buffer
(``proctor.batching.aggregator``), so the local generation batch must be a multiple of
``service_target_bs = lcm(rollout, ref, old)`` for every stage to cut it into whole chunks. Left unset,
``steps_per_generation`` is derived to make it so.

Packed passes lay each row's real tokens out contiguously (left-padded to the micro-batch's width, a multiple of
``sequence_length_round``), so every micro-batch is a ``rows × width`` rectangle within the token budget, and
scatter the per-token results back into the ``(batch, completion_length)`` layout TRL expects. Results equal
stock TRL's within floating-point noise (RoPE is shift-invariant; measured ≤ 1e-5 in fp32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

from proctor.batching.dynamic import plan_dynamic_batches
from proctor.batching.lcm import chunk_slices, lcm
from proctor.client.rewards import RemoteReward

__all__ = ["BatchingLog", "ProctorGRPOConfig", "ProctorGRPOTrainer"]

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

    def __post_init__(self) -> None:
        derive_steps = self.steps_per_generation is None and self.generation_batch_size is None
        super().__post_init__()
        for name in ("rollout_micro_batch_size", "ref_logps_micro_batch_size", "old_logps_micro_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
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
        target = self.service_target_bs
        assert self.steps_per_generation is not None  # resolved by GRPOConfig.__post_init__
        local = self.per_device_train_batch_size * self.steps_per_generation
        if local % target == 0:
            return
        sizes = self._micro_sizes_text()
        if not derive_steps:
            raise ValueError(
                f"the local generation batch, per_device_train_batch_size ({self.per_device_train_batch_size}) × "
                f"steps_per_generation ({self.steps_per_generation}) = {local} rows, is not a multiple of "
                f"service_target_bs = lcm({sizes}) = {target}: set steps_per_generation to a multiple of "
                f"{target // math.gcd(target, self.per_device_train_batch_size)}, leave it unset to have it derived, "
                "or change the micro-batch sizes"
            )
        # The smallest multiple of gradient_accumulation_steps that makes whole chunks: generations stay aligned
        # with optimizer steps (TRL then needs no old-policy pass for importance sampling).
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
        factor = target // math.gcd(target, per_step)
        self.steps_per_generation = self.gradient_accumulation_steps * factor
        self.generation_batch_size = self.per_device_train_batch_size * self.world_size * self.steps_per_generation

    @property
    def service_target_bs(self) -> int:
        """``lcm`` of the rollout, reference and old-policy micro-batch sizes that are set (1 if none is)."""
        sizes = [
            s
            for s in (self.rollout_micro_batch_size, self.ref_logps_micro_batch_size, self.old_logps_micro_batch_size)
            if s is not None
        ]
        return lcm(*sizes) if sizes else 1

    def _micro_sizes_text(self) -> str:
        named = [
            ("rollout", self.rollout_micro_batch_size),
            ("ref", self.ref_logps_micro_batch_size),
            ("old", self.old_logps_micro_batch_size),
        ]
        return ", ".join(f"{name} {size}" for name, size in named if size is not None)


@dataclass
class BatchingLog:
    """What the batching did, for tests and metrics: one entry per forward (or generate) call.

    Only the latest ``limit`` entries of each list are kept, so a long run does not grow it without bound.
    """

    limit: int = 10_000
    generate_rows: list[int] = field(default_factory=list)
    logps_calls: list[tuple[str, int, int]] = field(default_factory=list)  # (pass, rows, padded width)

    def record_generate(self, rows: int) -> None:
        self.generate_rows.append(rows)
        del self.generate_rows[: -self.limit]

    def record_logps(self, kind: str, rows: int, width: int) -> None:
        self.logps_calls.append((kind, rows, width))
        del self.logps_calls[: -self.limit]


class ProctorGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with chunked generation and chunked or token-budget-packed log-prob passes.

    Takes a :class:`ProctorGRPOConfig`; with a plain ``GRPOConfig`` it behaves exactly like ``GRPOTrainer``.
    Works with any ``datasets.Dataset``, a :class:`~proctor.client.RemoteRLDataset` included.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batching_log = BatchingLog()
        self._no_grad_calls = 0
        self._rollout_inputs: list[dict[str, Any]] | None = None

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

    # --- log-prob passes ------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._no_grad_calls = 0  # tells the old-policy pass from the reference pass (see _pass_kind)
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
            for reward in self.reward_funcs:
                if isinstance(reward, RemoteReward):
                    reward.post(inputs, completions, completion_ids)
        return out

    def _pass_kind(self, model: Any) -> str:
        """``old`` or ``ref`` for a no-grad log-prob pass. TRL computes the old-policy pass first, and only
        when generation and optimizer steps are misaligned (or vLLM's importance sampling is on)."""
        if self.ref_model is not None and model is self.ref_model:
            return "ref"
        args: Any = self.args
        generate_every = args.steps_per_generation * self.num_iterations
        old_expected = args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )
        self._no_grad_calls += 1
        return "old" if old_expected and self._no_grad_calls == 1 else "ref"

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
        """The pass packed by token budget: micro-batches of similar real lengths, each a ``rows × width``
        rectangle within ``budget``; results scattered back to stock TRL's ``(batch, logits_to_keep)`` layout."""
        assert budget is not None  # ProctorGRPOConfig refuses dynamic batching without a budget
        rows, total = input_ids.shape
        prompt_cols = total - logits_to_keep
        # TRL's layout: prompts left-padded to prompt_cols, completions right-padded after them.
        prompt_lens = attention_mask[:, :prompt_cols].sum(1)
        completion_lens = attention_mask[:, prompt_cols:].sum(1)
        plan = plan_dynamic_batches(
            (prompt_lens + completion_lens).tolist(), max_tokens_per_microbatch=budget, sequence_length_round=round_to
        )
        pad_id = self._tokenizer.pad_token_id
        device = input_ids.device
        keep = torch.arange(logits_to_keep, device=device)
        placed: list[torch.Tensor] = []
        logp_parts: list[torch.Tensor] = []
        entropy_parts: list[torch.Tensor] = []
        # Whole-micro-batch tensor ops, no per-row loop: on a GPU each op is a kernel launch.
        for micro in plan.ranks[0]:
            width = micro.padded_len
            index = torch.tensor(micro.indices, device=device)
            p, c = prompt_lens[index, None], completion_lens[index, None]
            col = torch.arange(width, device=device)[None, :]
            # Each row's real tokens, contiguous and right-aligned: [pads][prompt][completion].
            real = col >= width - p - c
            source = (col - width + c + prompt_cols).clamp(0, total - 1)
            ids = input_ids[index].gather(1, source).masked_fill(~real, pad_id)
            labels = ids.masked_fill(col < width - c, -100)
            self.batching_log.record_logps(kind, micro.rows, width)
            with self.accelerator.autocast():
                outputs = model(input_ids=ids, attention_mask=real.to(attention_mask.dtype), labels=labels,
                                fused_lm_head=True)  # fmt: skip
            # log_probs[:, j] scores token j + 1, so completion token k (at column width - c + k) is at column
            # width - c - 1 + k: the last c columns, moved to the front as in TRL's (batch, logits_to_keep).
            scored = (width - 1 - c + keep[None, :]).clamp(0, width - 2)
            beyond = keep[None, :] >= c
            placed.append(index)
            logp_parts.append(outputs.log_probs.gather(1, scored).masked_fill(beyond, 0))
            if compute_entropy:
                entropy_parts.append(outputs.entropy.gather(1, scored).masked_fill(beyond, 0))
        order = (torch.cat(placed),)
        logps = _scatter((rows, logits_to_keep), order, logp_parts)
        entropies = _scatter((rows, logits_to_keep), order, entropy_parts) if compute_entropy else None
        return logps, entropies, None


def _scatter(shape: tuple[int, int], rows: tuple[torch.Tensor], parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Micro-batch rows back to their places in a zero ``shape`` tensor, out of place so gradients flow."""
    values = torch.cat(list(parts))
    return values.new_zeros(shape).index_put(rows, values)
