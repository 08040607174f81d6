"""The trainer side that needs the deep-learning stack: TRL's GRPO trainer with batched rollout passes
(``trainer``), the check that a model keeps packed sequences apart (``packing``) and ``proctor train``
(``command``). ``proctor.client`` itself imports none of it, so the dataserver client works without torch.
"""

from __future__ import annotations

__all__: list[str] = []
