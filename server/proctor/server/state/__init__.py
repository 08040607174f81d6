"""The records of a run's state, which the store persists and the domain computes with."""
