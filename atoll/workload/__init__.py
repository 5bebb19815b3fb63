"""The reference workload as an island process (``atoll island``): a GPT on the bundled text or on the
user's token file, with checkpoints. It uses the library (``atoll.islands``) like any user's script."""
