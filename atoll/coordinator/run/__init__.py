"""The run: requests in, decisions out, over the objects that own its state (:mod:`..state`).

- ``run_state``: :class:`RunState` builds the owners and sequences them; the ONE seal -> persist ->
  publish path for θ_0 and every round;
- ``decider``: the background task that closes rounds (it asks :mod:`..policy.rounds`);
- ``pushes`` / ``pulls``: a push planned, checked and committed; a long-poll answered;
- ``checks``: validation of what islands send (pure: raise a reason, change nothing);
- ``messages`` / ``errors``: the run's requests, answers and refusals as plain data (no protobuf);
- ``owners``: the owners handed together to pushes and pulls.
"""
