"""A tiny causal LM and tokenizer built offline, for the demo, the tests and the benchmarks.

No hub access: a byte-level BPE is trained on a small local corpus and a randomly initialised two-layer
Qwen2 is saved next to it. Real runs pass any Hugging Face model path instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "build_tiny_model", "run_defaults"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "what is the answer sum of plus minus times add one two three four five six seven eight nine ten "
    "you are a careful calculator think briefly if need then give only final number solve problem"
)
_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _corpus() -> list[str]:
    words = _WORDS.split()
    lines = []
    for i in range(600):
        a, b = (i * 7) % 100, (i * 13) % 100
        op = "+-*"[i % 3]
        lines.append(f"What is {a} {op} {b}? " + " ".join(words[(i + j) % len(words)] for j in range(8)))
    return lines


def build_tiny_model(
    folder: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    mlp_ratio: int = 2,
    seed: int = 0,
) -> Path:
    """Build (once) a tiny tokenizer + model in ``folder`` and return it; an existing build is reused.

    The model is a randomly initialised Qwen2 of the given shape; the benchmarks ask for larger ones.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",  # the end of an assistant turn ends a completion
        pad_token="<|pad|>",
        bos_token=None,
        padding_side="left",  # GRPOTrainer pads prompts on the left
        truncation_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=mlp_ratio * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def run_defaults(output_dir: str | Path, *, gpu: bool = False, seed: int = 0) -> dict[str, Any]:
    """``GRPOConfig`` fields for a quiet local run: the precision the device supports, no checkpoints, no
    reporters, a log line per step. TRL's own defaults (bf16, gradient checkpointing, logging every 10
    steps) suit a GPU cluster and fail or crawl on a CPU."""
    from transformers import TrainingArguments

    # transformers 5.23 renamed gradient checkpointing, and warns on every run that sets the old name.
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {
        "output_dir": str(output_dir),
        "use_cpu": not gpu,
        "bf16": gpu,
        checkpointing: False,
        "dataloader_pin_memory": gpu,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": seed,
    }
