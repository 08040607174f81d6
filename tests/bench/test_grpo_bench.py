"""bench/grpo_step.py and bench/grpo_gpu.py: forced completion lengths, per-phase measurement, the GPU script's
variants, table and CPU smoke path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoTokenizer, PrinterCallback
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # trl's __init__ does not re-export them

from bench import grpo_gpu
from bench.grpo_step import ForceLengths, bench_trainer, deal, long_tail_lengths, phase_summary, spread
from proctor.client.tiny import build_tiny_model, run_defaults
from proctor.client.training.trainer import ProctorGRPOConfig, ProctorGRPOTrainer


def test_long_tail_lengths_are_a_fixed_multiset_with_one_row_in_eight_near_the_maximum() -> None:
    lengths = long_tail_lengths(64, 4096, short=(64, 1024))

    assert lengths == long_tail_lengths(64, 4096, short=(64, 1024))
    assert len(lengths) == 64 and max(lengths) == 4096
    assert sum(n >= 3482 for n in lengths) == 8
    assert all(64 <= n <= 1024 for n in lengths if n < 3482)
    assert spread(lengths)["median"] < 1024


def test_deal_gives_every_variant_the_same_lengths_and_each_generation_its_own_order() -> None:
    lengths = long_tail_lengths(32, 128, short=(8, 24))

    assert deal(lengths, 32, generation=3) == deal(lengths, 32, generation=3)
    assert sorted(deal(lengths, 32, generation=3)) == lengths
    assert deal(lengths, 32, generation=3) != deal(lengths, 32, generation=4)


def test_force_lengths_ends_each_row_at_its_target_and_samples_inside_the_tokenizer() -> None:
    targets, prompt, eos, limit = [1, 3, 7, 5], 4, [2, 9], 40
    force = ForceLengths(targets, prompt, eos, vocab_limit=limit)
    ids = torch.zeros(len(targets), prompt, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    for _ in range(max(targets)):
        scores = torch.randn(len(targets), 64, generator=generator)
        scores[:, eos] = 10.0  # a model eager to stop
        scores[:, limit:] = 20.0  # and to say ids the tokenizer does not have
        assert isinstance(ids, torch.LongTensor)  # the type a logits processor's input_ids have
        chosen = force(ids, scores).argmax(1)
        ids = torch.cat([ids, chosen[:, None]], 1)

    completions = ids[:, prompt:]
    assert int(completions.max()) < limit
    for row, target in enumerate(targets):
        first_eos = next(i for i, t in enumerate(completions[row].tolist()) if t in eos)
        assert first_eos == target - 1
        assert completions[row, target - 1] == eos[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _train(model: Path, out: Path, variant: str, reward: Any = None) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(model)
    words = "what is one two three".split()
    prompts = [" ".join(words[: 2 + i % 4]) for i in range(32)]
    common: dict[str, Any] = {
        **run_defaults(out),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 16,
        "max_steps": 2,
        "beta": 0.04,
        "num_iterations": 2,
    }
    if variant == "stock":
        config: Any = GRPOConfig(**common)
        base: type[Any] = GRPOTrainer
    else:
        knobs: dict[str, Any] = (
            {"rollout_micro_batch_size": 2, "old_logps_micro_batch_size": 4, "ref_logps_micro_batch_size": 4}
            if variant == "chunked"
            else {
                "use_dynamic_batching_in_infer": True,
                "max_tokens_per_microbatch_in_infer": 48,
                "use_dynamic_batching_in_train": True,
                "max_tokens_per_microbatch_in_train": 48,
            }
        )
        config = ProctorGRPOConfig(**common, **knobs)
        base = ProctorGRPOTrainer
    trainer = bench_trainer(base)(
        model=str(model),
        reward_funcs=reward or (lambda completions, **_: [float(len(c)) for c in completions]),
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        forced_lengths=long_tail_lengths(8, 16, short=(2, 5)),
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


@pytest.mark.e2e  # a whole GRPO run of the benchmark
@pytest.mark.parametrize("variant", ["stock", "chunked", "dynamic"])
def test_a_forced_run_realises_the_targets_and_measures_every_phase(tiny: Path, tmp_path: Path, variant: str) -> None:
    trainer = _train(tiny, tmp_path, variant)
    trainer.train()

    [(targets, realised)] = trainer.forced_log  # one generation serves both steps (num_iterations 2)
    assert realised == targets
    assert sorted(targets) == long_tail_lengths(8, 16, short=(2, 5))
    phases = phase_summary(trainer.phase_events)
    assert [e["phase"] for e in trainer.phase_events] == ["generation", "old", "ref", "train", "train"]
    assert phases["generation"]["tokens"] == sum(targets)
    assert phases["old"]["tokens"] == phases["ref"]["tokens"] == phases["train"]["tokens"] / 2
    forwards = {"stock": 1, "chunked": 2}.get(variant)
    if forwards is not None:  # stock TRL and row chunks pad every row to the longest one
        assert phases["old"]["forwards_per_call"] == phases["ref"]["forwards_per_call"] == forwards
        assert phases["train"]["forwards_per_call"] == 1
        assert phases["train"]["padding"] > 1.5
    else:  # packed: several micro-batches within the budget, little padding
        assert phases["ref"]["forwards_per_call"] > 1 and phases["train"]["forwards_per_call"] > 1
        assert phases["train"]["padding"] < 1.5
    assert all(p["peak_mib"] is None for p in phases.values())  # no GPU


@pytest.mark.e2e  # a whole GRPO run of the benchmark
def test_a_phase_that_raises_stays_named(tiny: Path, tmp_path: Path) -> None:
    def reward(**_: Any) -> list[float]:
        raise RuntimeError("the reward failed")

    trainer = _train(tiny, tmp_path, "stock", reward=reward)
    with pytest.raises(RuntimeError, match="the reward failed"):
        trainer.train()

    assert trainer.current_phase == "rollout"  # an out-of-memory error is placed the same way
    assert [e["phase"] for e in trainer.phase_events] == ["generation", "old", "ref"]  # TRL scores after them


def test_the_gpu_variants_are_stock_chunked_two_budgets_and_the_probe() -> None:
    runs = grpo_gpu.variants([16384, 32768], prompts=8, probe_prompts=16)

    assert [r["variant"] for r in runs] == [
        "stock",
        "chunked",
        "dynamic 16384",
        "dynamic 32768",
        "probe stock",
        "probe dynamic 16384",
    ]
    assert [r["prompts"] for r in runs] == [8, 8, 8, 8, 16, 16]
    assert runs[1]["knobs"] == {
        "rollout_micro_batch_size": 32,
        "old_logps_micro_batch_size": 16,
        "ref_logps_micro_batch_size": 16,
    }


def test_the_gpu_script_refuses_to_run_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    with pytest.raises(SystemExit, match="no CUDA device"):
        grpo_gpu.main(["--out", str(tmp_path / "r.json")])


# TRL 1.16 turns gradient checkpointing off for the no-grad passes through a name transformers 5.23 deprecates.
@pytest.mark.e2e  # a whole GRPO run of the benchmark
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(en|dis)able` is deprecated:FutureWarning")
def test_the_gpu_code_path_runs_on_the_cpu_and_tabulates(tmp_path: Path) -> None:
    model = grpo_gpu.build_model(tmp_path / "smoke", "smoke", vocab=1024, smoke=True)
    spec = {
        "variant": "dynamic 256",
        "prompts": 1,
        "knobs": {"budget": 256},
        "shape": "smoke",
        "attn": "sdpa",
        "model": str(model),
        "workdir": str(tmp_path),
        "max_len": 32,
        "steps": 2,
        "smoke": True,
        "round": 8,
        "gradient_checkpointing": True,
    }

    result = grpo_gpu.run_variant(spec)

    assert result["status"] == "ok" and result["lengths_match"]
    assert result["lengths"]["max"] == 32
    assert set(result["phases"]) == {"generation", "old", "ref", "train"}
    assert result["trainer_metrics"]["batching/train_micro_batches"] >= 1
    oom = {**result, "variant": "probe stock", "status": "oom", "oom_phase": "train", "phases": {}}
    payload = {"device": "CPU", "results": [result, oom], "config": {"lengths": [4, 8, 32], "steps": 2}}
    text = grpo_gpu.table(payload)
    assert "| dynamic 256 | 8 | ok |" in text
    assert "| probe stock | 8 | oom (train) |" in text
