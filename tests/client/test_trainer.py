"""ProctorGRPOTrainer on the tiny offline model: chunked and packed passes equal stock TRL's, chunk sizes are
the configured ones, the config derives or refuses steps_per_generation, and a run with every knob trains."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from proctor.client.tiny import run_defaults
from proctor.client.training.trainer import BatchingLog, ProctorGRPOConfig, ProctorGRPOTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = "what is one two three four five add sum plus the answer".split()


def config(tmp_path: Path, cls: type[GRPOConfig] = ProctorGRPOConfig, /, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        **run_defaults(tmp_path / "run"),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 1e-2,
    }
    values.update(overrides)
    return cls(**values)


def prompts(n: int) -> datasets.Dataset:
    rows = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 5)) for i in range(n)]
    return datasets.Dataset.from_dict({"prompt": rows})


def length_reward(completions: list[str], **_: Any) -> list[float | None]:
    return [min(1.0, len(c) / 20) for c in completions]


def trainer(tiny_model: Path, args: Any, cls: type[GRPOTrainer] = ProctorGRPOTrainer) -> Any:
    return cls(
        model=str(tiny_model),
        reward_funcs=length_reward,
        args=args,
        train_dataset=prompts(32),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )


def batch(tiny_model: Path, n: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A GRPO-shaped batch: prompts left-padded, completions right-padded, lengths all different."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(seed)
    prompt_cols, completion_cols = 9, 7
    ids = torch.full((n, prompt_cols + completion_cols), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(n):
        p = int(torch.randint(2, prompt_cols + 1, (1,), generator=g))
        c = int(torch.randint(0 if i == 3 else 1, completion_cols + 1, (1,), generator=g))
        ids[i, prompt_cols - p : prompt_cols + c] = torch.randint(10, len(tok), (p + c,), generator=g)
        mask[i, prompt_cols - p : prompt_cols + c] = 1
    return ids, mask, completion_cols


def stock(t: Any, model: Any, ids: torch.Tensor, mask: torch.Tensor, keep: int, **kw: Any) -> Any:
    return GRPOTrainer._get_per_token_logps_and_entropies(t, model, ids, mask, keep, **kw)


# --- config ----------------------------------------------------------------------------------------------


def test_service_target_bs_is_the_lcm_of_the_set_sizes(tmp_path: Path) -> None:
    args = config(tmp_path, rollout_micro_batch_size=4, ref_logps_micro_batch_size=6, old_logps_micro_batch_size=3)
    assert args.service_target_bs == 12
    assert config(tmp_path).service_target_bs == 1


def test_steps_per_generation_is_derived_to_make_whole_chunks(tmp_path: Path) -> None:
    # 4 rows per step, chunks of lcm(8, 3) = 24: the smallest multiple of GA (=1) with 4·S % 24 == 0 is 6.
    args = config(tmp_path, rollout_micro_batch_size=8, old_logps_micro_batch_size=3)
    assert (args.steps_per_generation, args.generation_batch_size) == (6, 24)
    # With gradient accumulation 2 it stays a multiple of it, so generations stay aligned with optimizer steps.
    args = config(tmp_path, rollout_micro_batch_size=8, gradient_accumulation_steps=2)
    assert args.steps_per_generation == 2
    assert config(tmp_path, rollout_micro_batch_size=4).steps_per_generation == 1


def test_an_explicit_steps_per_generation_that_cuts_chunks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        config(tmp_path, rollout_micro_batch_size=8, ref_logps_micro_batch_size=3, steps_per_generation=1)
    assert str(info.value) == (
        "the local generation batch, per_device_train_batch_size (4) × steps_per_generation (1) = 4 rows, is not a "
        "multiple of the service batch lcm(rollout 8, ref 3) = 24: set steps_per_generation to a multiple of 6, "
        "leave it unset to have it derived, or change the micro-batch sizes"
    )


@pytest.mark.parametrize("phase", ["infer", "train"])
def test_dynamic_batching_needs_a_budget(tmp_path: Path, phase: str) -> None:
    with pytest.raises(
        ValueError, match=f"use_dynamic_batching_in_{phase}=True needs max_tokens_per_microbatch_in_{phase}"
    ):
        config(tmp_path, **{f"use_dynamic_batching_in_{phase}": True})


def test_micro_batch_sizes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="old_logps_micro_batch_size must be a positive integer, got 0"):
        config(tmp_path, old_logps_micro_batch_size=0)


def test_the_derived_sizes_are_described(tmp_path: Path) -> None:
    sizes = config(tmp_path, rollout_micro_batch_size=8, gradient_accumulation_steps=2).batch_sizes
    assert sizes.describe() == (
        "4 rows per micro-step × 2 accumulated × 1 devices = 8 rows per update; steps_per_generation 2 (derived): "
        "8 rows generated per device, service batch 8 = lcm(rollout 8)"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"top_entropy_quantile": 0.5},
            "use_dynamic_batching_in_train does not support top_entropy_quantile < 1: it needs the whole "
            "micro-step's entropies before any backward: turn it off, or set use_dynamic_batching_in_train=False",
        ),
        (
            {"entropy_coef": 0.01},
            "use_dynamic_batching_in_train does not support an entropy bonus (entropy_coef or use_adaptive_entropy)",
        ),
    ],
)
def test_training_settings_that_need_the_whole_micro_step_are_refused(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        config(tmp_path, use_dynamic_batching_in_train=True, max_tokens_per_microbatch_in_train=64, **overrides)
    assert str(info.value).startswith(message)


def test_padding_free_takes_auto_or_off(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="padding_free must be 'auto' or 'off', got 'yes'"):
        config(tmp_path, padding_free="yes")


# --- log-prob passes -------------------------------------------------------------------------------------


def test_the_batching_log_keeps_only_the_latest_entries() -> None:
    log = BatchingLog(limit=3)
    for rows in range(5):
        log.record_generate(rows)
        log.record_logps("ref", rows, 8)
    assert log.generate_rows == [2, 3, 4]
    assert log.logps_calls == [("ref", 2, 8, False), ("ref", 3, 8, False), ("ref", 4, 8, False)]


@pytest.mark.parametrize("mbs", [1, 3, 4, 10])
def test_chunked_logps_equal_stock_and_use_the_configured_chunks(tiny_model: Path, tmp_path: Path, mbs: int) -> None:
    t = trainer(tiny_model, config(tmp_path, old_logps_micro_batch_size=mbs, ref_logps_micro_batch_size=mbs))
    ids, mask, keep = batch(tiny_model)
    with torch.no_grad():
        expected, _, _ = stock(t, t.model, ids, mask, keep)
        got, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, keep, batch_size=4)
    assert torch.allclose(got, expected, atol=1e-5)
    assert [call.rows for call in t.batching_log.logps_calls] == [min(mbs, 10 - s) for s in range(0, 10, mbs)]


@pytest.mark.parametrize("padding_free", ["auto", "off"])
@pytest.mark.parametrize(("budget", "round_to"), [(16, 1), (32, 1), (48, 4), (200, 8)])
def test_packed_logps_equal_stock(
    tiny_model: Path, tmp_path: Path, budget: int, round_to: int, padding_free: str
) -> None:
    t = trainer(
        tiny_model,
        config(
            tmp_path,
            use_dynamic_batching_in_infer=True,
            max_tokens_per_microbatch_in_infer=budget,
            sequence_length_round_in_infer=round_to,
            padding_free=padding_free,
        ),
    )
    ids, mask, keep = batch(tiny_model)
    with torch.no_grad():
        expected, _, _ = stock(t, t.model, ids, mask, keep)
        got, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, keep, batch_size=4)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5
    lengths = mask.sum(1).tolist()
    calls = t.batching_log.logps_calls
    # The tiny Qwen2 runs sdpa, which keeps packed sequences apart: "auto" packs them with no padding at all.
    assert {call.packed for call in calls} == {padding_free == "auto"}
    assert sum(call.rows for call in calls) == len(lengths)
    for call in calls:
        # Every micro-batch is within the budget, unless it is one sequence longer than the budget on its own.
        tokens = call.width if call.packed else call.rows * call.width
        assert tokens <= budget or (call.rows == 1 and call.width >= max(lengths) and call.width > budget)
        assert call.width % round_to == 0


def test_the_packed_training_pass_gives_stock_values_and_gradients(tiny_model: Path, tmp_path: Path) -> None:
    t = trainer(tiny_model, config(tmp_path, use_dynamic_batching_in_train=True, max_tokens_per_microbatch_in_train=24))
    ids, mask, keep = batch(tiny_model)
    params = [p for p in t.model.parameters() if p.requires_grad]

    def run(fn: Any) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        t.model.zero_grad()
        logps, entropies, _ = fn()
        (logps.sum() + 0.1 * entropies.sum()).backward()
        return logps.detach(), entropies.detach(), [p.grad.clone() for p in params]

    lp0, ent0, g0 = run(lambda: stock(t, t.model, ids, mask, keep, compute_entropy=True))
    lp1, ent1, g1 = run(lambda: t._get_per_token_logps_and_entropies(t.model, ids, mask, keep, compute_entropy=True))
    assert torch.allclose(lp0, lp1, atol=1e-5)
    assert torch.allclose(ent0, ent1, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(g0, g1, strict=True))
    assert len(t.batching_log.logps_calls) > 1  # it really was split


def test_a_plain_grpo_config_keeps_stock_behaviour(tiny_model: Path, tmp_path: Path) -> None:
    t = trainer(tiny_model, config(tmp_path, GRPOConfig))
    ids, mask, keep = batch(tiny_model)
    with torch.no_grad():
        expected, _, _ = stock(t, t.model, ids, mask, keep, batch_size=4)
        got, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, keep, batch_size=4)
    assert torch.equal(got, expected)
    assert t.batching_log.logps_calls == []


# --- generation ------------------------------------------------------------------------------------------


def test_chunked_generation_gives_stock_completions(tiny_model: Path, tmp_path: Path) -> None:
    greedy = {"generation_kwargs": {"do_sample": False}}
    chunked = trainer(tiny_model, config(tmp_path, rollout_micro_batch_size=3, **greedy))
    plain = trainer(tiny_model, config(tmp_path, GRPOConfig, **greedy))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = [tok(text)["input_ids"] for text in prompts(8)["prompt"]]
    got, _ = chunked._generate_single_turn(prompt_ids, None, {}, 1)
    expected, _ = plain._generate_single_turn(prompt_ids, None, {}, 1)
    assert got == expected
    assert chunked.batching_log.generate_rows == [3, 3, 2]


# --- training --------------------------------------------------------------------------------------------


@pytest.mark.e2e  # a whole GRPO run
def test_a_run_with_every_knob_trains(tiny_model: Path, tmp_path: Path) -> None:
    args = config(
        tmp_path,
        max_steps=3,
        beta=0.04,  # a reference pass
        num_iterations=2,  # an old-policy pass
        gradient_accumulation_steps=2,
        rollout_micro_batch_size=2,
        ref_logps_micro_batch_size=4,
        old_logps_micro_batch_size=2,
        use_dynamic_batching_in_infer=True,
        max_tokens_per_microbatch_in_infer=64,
        use_dynamic_batching_in_train=True,
        max_tokens_per_microbatch_in_train=48,
    )
    t = trainer(tiny_model, args)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[n], p) for n, p in t.model.named_parameters())
    kinds = {call.kind for call in t.batching_log.logps_calls}
    assert kinds == {"old", "ref", "train"}
    assert set(t.batching_log.generate_rows) == {2}


def test_the_old_and_reference_passes_of_a_lora_policy_are_told_apart_by_its_adapters(
    tiny_model: Path, tmp_path: Path
) -> None:
    from peft import LoraConfig
    from trl.trainer.utils import use_adapter

    args = config(
        tmp_path, max_steps=1, beta=0.04, num_iterations=2, old_logps_micro_batch_size=2, ref_logps_micro_batch_size=3
    )
    t = ProctorGRPOTrainer(
        model=str(tiny_model),
        reward_funcs=length_reward,
        args=args,
        train_dataset=prompts(8),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    assert t.ref_model is None  # the reference pass runs on the policy with its adapters off
    t.train()
    no_grad = [(call.kind, call.rows) for call in t.batching_log.logps_calls if call.kind != "train"]
    # 12 rows per generation (steps_per_generation derived to 3, for whole chunks of lcm(2, 3) = 6 rows).
    assert no_grad == [("old", 2)] * 6 + [("ref", 3)] * 4

    # In any order and any number of times: the signal is the adapter state, not the calls before.
    ids, mask, keep = batch(tiny_model, n=3)
    kinds = []
    with torch.no_grad():
        for reference in (True, True, False, True, False, False):
            t.batching_log.logps_calls.clear()
            if reference:
                with use_adapter(t.accelerator.unwrap_model(t.model), adapter_name=None):
                    t._get_per_token_logps_and_entropies(t.model, ids, mask, keep)
            else:
                t._get_per_token_logps_and_entropies(t.model, ids, mask, keep)
            kinds.append(t.batching_log.logps_calls[0].kind)
    assert kinds == ["ref", "ref", "old", "ref", "old", "old"]
