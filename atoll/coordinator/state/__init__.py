"""What the run holds, each piece with one owner.

- ``membership``: islands, leases, sessions, departures, the bootstrap claim;
- ``accumulator``: the open round's sum and its contributions; ``plans``: a push while it is held
  (its plan, its staged ranks); ``budget``: the in-flight bytes pushes and pulls may hold;
- ``model``: θ, the outer optimizer and the downlink error feedback; ``outer``: the outer step's
  tensor math and θ's finiteness proof; ``robust``: robust aggregation; ``regions``: tensor regions;
- ``ledger``: the open round, the closed rounds' records, the sealed round, the wake-up events;
- ``downlink``: what islands pull (the latest update, catch-ups from the log, the full θ).
"""
