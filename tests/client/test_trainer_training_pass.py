"""The training pass under a token budget: forward and backward per micro-batch, gradients equal to stock TRL's
for every loss type, and micro-batches of one-token rows that neither crash nor change the result."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from proctor.batching.dynamic import plan_dynamic_batches
from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
BUDGET = 24


def zero_reward(completions: list[str], **_: Any) -> list[float | None]:
    return [0.0] * len(completions)


def make(tiny_model: Path, tmp_path: Path, cls: type[GRPOConfig], trainer_cls: type[GRPOTrainer], **kw: Any) -> Any:
    values: dict[str, Any] = {
        **run_defaults(tmp_path / cls.__name__),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 1,
    }
    args = cls(**{**values, **kw})
    return trainer_cls(
        model=str(tiny_model),
        reward_funcs=zero_reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["what is"] * 8}),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )


def micro_step(t: Any, seed: int, *, prompt_lens: list[int], completion_lens: list[int]) -> dict[str, Any]:
    """A GRPO micro-step as TRL's _prepare_inputs hands it over: left-padded prompts, right-padded completions,
    advantages, and old/ref log-probs near the model's own (so that ratios and clipping are not all 1)."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_cols, completion_cols = len(prompt_lens), max(prompt_lens), 8
    prompt_ids = torch.zeros(rows, prompt_cols, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros(rows, completion_cols, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens, strict=True)):
        prompt_ids[i, prompt_cols - p :] = torch.randint(10, 400, (p,), generator=g)
        prompt_mask[i, prompt_cols - p :] = 1
        completion_ids[i, :c] = torch.randint(10, 400, (c,), generator=g)
        completion_mask[i, :c] = 1
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        current, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(t, t.model, ids, mask, completion_cols)
    noise = torch.randn(current.shape, generator=g)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=g),
        "old_per_token_logps": current + 0.3 * noise,
        "ref_per_token_logps": current - 0.2 * noise.flip(0),
        "num_items_in_batch": completion_mask.sum().float() * 2,  # as if the generation batch held two micro-steps
    }


def gradients(t: Any, inputs: dict[str, Any]) -> tuple[float, list[torch.Tensor]]:
    t.model.train()
    t.model.zero_grad()
    t.current_gradient_accumulation_steps = 2
    loss = t.compute_loss(t.model, inputs)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in t.model.parameters()]


PROMPTS = [1, 3, 7, 2, 9, 4, 5, 2]
COMPLETIONS = [8, 1, 6, 0, 8, 3, 7, 2]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_per_micro_batch_gradients_equal_stock(tiny_model: Path, tmp_path: Path, loss_type: str) -> None:
    kw: dict[str, Any] = {"loss_type": loss_type, "beta": 0.04, "steps_per_generation": 2}
    if loss_type == "luspo":
        kw["importance_sampling_level"] = "sequence"  # TRL refuses luspo otherwise
    stock = make(tiny_model, tmp_path, GRPOConfig, GRPOTrainer, **kw)
    ours = make(
        tiny_model, tmp_path, ProctorGRPOConfig, ProctorGRPOTrainer,
        use_dynamic_batching_in_train=True, max_tokens_per_microbatch_in_train=BUDGET, **kw,
    )  # fmt: skip
    inputs = micro_step(stock, 1, prompt_lens=PROMPTS, completion_lens=COMPLETIONS)
    expected_loss, expected = gradients(stock, inputs)

    # The backward of every micro-batch but the last runs inside compute_loss, before the Trainer's own.
    backward_passes: list[int] = []
    weight = ours.model.get_input_embeddings().weight
    hook = weight.register_post_accumulate_grad_hook(lambda _: backward_passes.append(1))
    ours.model.train()
    ours.model.zero_grad()
    ours.current_gradient_accumulation_steps = 2
    loss = ours.compute_loss(ours.model, inputs)
    inside = len(backward_passes)
    loss.backward()
    hook.remove()
    got = [p.grad.clone() for p in ours.model.parameters()]

    lengths = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    micros = plan_dynamic_batches(lengths, max_tokens_per_microbatch=BUDGET).ranks[0]
    assert len(micros) > 2
    assert [call.rows for call in ours.batching_log.logps_calls] == [m.rows for m in micros]
    assert (inside, len(backward_passes)) == (len(micros) - 1, len(micros))
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-5
    assert max(g.abs().max().item() for g in expected) > 1e-3  # the gradient is not trivially zero

    if loss_type not in ("dapo", "cispo", "vespo"):
        # Each micro-batch's loss left as TRL computes it for its rows alone (no share of the micro-step) gives
        # a clearly different gradient: the comparison above would catch a normaliser that is off.
        stock.model.zero_grad()
        for micro in micros:
            index = torch.tensor(micro.indices)
            part = {k: v[index] if k != "num_items_in_batch" else v for k, v in inputs.items()}
            stock.compute_loss(stock.model, part).backward()
        naive = [p.grad.clone() for p in stock.model.parameters()]
        assert max((a - b).abs().max().item() for a, b in zip(naive, expected, strict=True)) > 1e-3


@pytest.mark.parametrize("padding_free", ["auto", "off"])
def test_a_micro_batch_of_one_token_rows_gives_zeros_not_a_crash(
    tiny_model: Path, tmp_path: Path, padding_free: str
) -> None:
    # A one-token prompt whose completions were all truncated and masked: rows one token long, alone in their
    # micro-batch once rows are sorted by length.
    kw: dict[str, Any] = {
        "use_dynamic_batching_in_infer": True,
        "max_tokens_per_microbatch_in_infer": 4,
        "use_dynamic_batching_in_train": True,
        "max_tokens_per_microbatch_in_train": 4,
        "padding_free": padding_free,
    }
    ours = make(tiny_model, tmp_path, ProctorGRPOConfig, ProctorGRPOTrainer, **kw)
    stock = make(tiny_model, tmp_path, GRPOConfig, GRPOTrainer)
    inputs = micro_step(stock, 2, prompt_lens=[1, 1, 1, 1, 2, 3, 1, 1], completion_lens=[0, 0, 0, 0, 2, 1, 0, 0])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, 8)
        expected, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(stock, stock.model, ids, mask, 8)
    completion = inputs["completion_mask"].bool()
    assert logps.shape == expected.shape
    assert torch.equal(logps[~completion], torch.zeros(int((~completion).sum())))
    assert (logps[completion] - expected[completion]).abs().max().item() <= 1e-5
    assert any(call.rows >= 2 and call.width <= 2 for call in ours.batching_log.logps_calls)

    expected_loss, expected_grads = gradients(stock, inputs)
    loss, grads = gradients(ours, inputs)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(grads, expected_grads, strict=True)) <= 1e-5


def test_a_run_on_a_one_token_prompt_with_masked_truncations_trains(tiny_model: Path, tmp_path: Path) -> None:
    # The shape TRL's own test suite found: a one-token prompt, completions cut at 3 tokens by a model that never
    # says EOS, masked by mask_truncated_completions, passes packed with no rounding.
    t = make(
        tiny_model, tmp_path, ProctorGRPOConfig, ProctorGRPOTrainer,
        max_completion_length=3, mask_truncated_completions=True, beta=0.04, num_iterations=2,
        use_dynamic_batching_in_infer=True, max_tokens_per_microbatch_in_infer=8,
        use_dynamic_batching_in_train=True, max_tokens_per_microbatch_in_train=8,
    )  # fmt: skip
    t.train_dataset = datasets.Dataset.from_dict({"prompt": ["what"] * 8})
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert {call.kind for call in t.batching_log.logps_calls} == {"old", "ref", "train"}
