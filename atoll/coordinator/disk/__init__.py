"""The state dir: what makes the run survive a crash and what refuses a dir that cannot be trusted.

- ``wal``: the write-ahead log, one record per round, written before the round is published;
- ``snapshots``: verified full snapshots, the restore (the newest snapshot and the log after it),
  rollback, the newest round published, departures;
- ``writer``: what is written when (θ_0, a round's record; in the background, the optimizer state and
  the snapshots every few rounds);
- ``verified``: the file format, safetensors with a CRC-32C per tensor, checked before it is trusted;
- ``lock``: one writer per state dir.
"""
