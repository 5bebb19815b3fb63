"""Decisions as pure functions, tested by building a state by hand and moving a clock.

- ``rounds``: when a round closes (``decide``, ``next_wakeup``, ``stall``); ``grace``: how long a
  round with its quorum waits for the missing islands;
- ``weighting``: where a push stands against the open round and how much it weighs in the mean (the
  one place for tokens, staleness and step count);
- ``goodput``: compute that entered θ over time joined.
"""
