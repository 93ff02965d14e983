"""RotaryQuant: huge MoE models on a laptop."""

__version__ = "0.1.0"
