"""Whether a model's attention keeps sequences apart when they are packed back to back in one row.

Padding-free packing feeds several sequences as one row with position ids that restart at each sequence and
no attention mask. transformers' flash-attention, flex and (from the position ids) sdpa/eager paths then attend
within each sequence only; an implementation that ignores the position ids lets every token attend to the
sequences before it and scores them wrongly, with no error. So the capability is checked on the model itself.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["keeps_packed_sequences_apart"]

# A packed sequence's logits may differ from the same sequence run alone by kernel noise (bf16 on a GPU), never
# by a sizeable fraction of what attending across the boundary changes.
_TOLERANCE = 0.05


def keeps_packed_sequences_apart(model: Any, *, config: Any | None = None) -> bool:
    """Whether ``model`` scores two sequences packed in one row (position ids restarting, no attention mask) as
    it scores each alone: three small forwards, compared.

    ``model`` may be a wrapper (DDP, FSDP) that runs the forward; ``config`` is then the wrapped model's.
    """
    config = config if config is not None else model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(config.vocab_size, (6,), generator=generator).to(device)
    second = torch.randint(config.vocab_size, (5,), generator=generator).to(device)
    both = torch.cat([first, second])[None]
    restarting = torch.cat([torch.arange(6), torch.arange(5)]).to(device)[None]
    training = model.training
    model.eval()  # dropout would make the three forwards differ for its own reasons
    try:
        with torch.no_grad():
            alone = model(input_ids=second[None], use_cache=False).logits[0].float()
            packed = model(input_ids=both, position_ids=restarting, use_cache=False).logits[0, 6:].float()
            # What a kernel that ignores the boundary computes: the second sequence attending to the first.
            joined = model(input_ids=both, use_cache=False).logits[0, 6:].float()
    finally:
        model.train(training)
    crossing = float((joined - alone).abs().max())
    error = float((packed - alone).abs().max())
    return crossing > 0 and error <= _TOLERANCE * crossing
