"""atoll: low-communication decentralised training (DiLoCo) across islands."""

__version__ = "0.1.0"
