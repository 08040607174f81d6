"""Padding-free packing is taken only where the model's attention keeps packed sequences apart: checked on the
model, with the padded layout as the fallback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from proctor.client.tiny import run_defaults
from proctor.client.training.packing import keeps_packed_sequences_apart
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def causal_only(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """An attention kernel that knows causality only: no masks, no sequence boundaries from position ids."""
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


AttentionInterface.register("causal_only", causal_only)


@pytest.mark.parametrize(("implementation", "packs"), [("sdpa", True), ("eager", True), ("causal_only", False)])
def test_the_check_tells_which_attention_keeps_sequences_apart(
    tiny_model: Path, implementation: str, packs: bool
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=implementation)
    model.train()
    assert keeps_packed_sequences_apart(model) is packs
    assert model.training  # the check leaves the model as it found it


def scored(tiny_model: Path, tmp_path: Path, implementation: str, padding_free: str) -> tuple[Any, torch.Tensor]:
    args = ProctorGRPOConfig(
        **run_defaults(tmp_path / padding_free),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_dynamic_batching_in_infer=True,
        max_tokens_per_microbatch_in_infer=24,
        padding_free=padding_free,
        model_init_kwargs={"attn_implementation": implementation},
    )
    t = ProctorGRPOTrainer(
        model=str(tiny_model),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["what is"] * 4}),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )
    g = torch.Generator().manual_seed(0)
    lengths = [(2, 5), (7, 1), (3, 8), (1, 3), (9, 6), (4, 0)]
    ids = torch.zeros(len(lengths), 17, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(lengths):
        ids[row, 9 - p : 9 + c] = torch.randint(10, 400, (p + c,), generator=g)
        mask[row, 9 - p : 9 + c] = 1
    with torch.no_grad():
        logps, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, 8)
    return t, logps


def test_an_attention_that_ignores_position_ids_gets_the_padded_layout(tiny_model: Path, tmp_path: Path) -> None:
    auto, got = scored(tiny_model, tmp_path, "causal_only", "auto")
    off, expected = scored(tiny_model, tmp_path, "causal_only", "off")
    assert {call.packed for call in auto.batching_log.logps_calls} == {False}
    assert auto.batching_log.logps_calls == off.batching_log.logps_calls
    assert torch.equal(got, expected)


def test_an_attention_that_keeps_sequences_apart_packs_with_no_padding(tiny_model: Path, tmp_path: Path) -> None:
    auto, got = scored(tiny_model, tmp_path, "sdpa", "auto")
    _, expected = scored(tiny_model, tmp_path, "sdpa", "off")
    calls = auto.batching_log.logps_calls
    assert {call.packed for call in calls} == {True}
    assert sum(call.width for call in calls) == sum(p + c for p, c in [(2, 5), (7, 1), (3, 8), (1, 3), (9, 6), (4, 0)])
    assert (got - expected).abs().max().item() <= 1e-5
