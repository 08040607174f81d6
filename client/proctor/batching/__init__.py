"""Rollout batching, framework-agnostic (numpy/torch only, no TRL import).

- :mod:`~proctor.batching.lcm`: ``lcm`` of micro-batch sizes, and chunk slices.
- :mod:`~proctor.batching.vocabulary`: the batch-size vocabulary (global, mini, micro, dispatch sizes; and
  TRL's rows per device, steps per generation and service batch) derived from a few numbers, with errors
  that say which number to change.
- :mod:`~proctor.batching.dynamic`: token-budget dynamic batching (sort, balance across DP ranks,
  cap every micro-batch's padded rectangle, equal micro-batch counts, a permutation to restore order).
"""
