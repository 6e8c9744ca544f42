"""regen: prompt-completion regeneration and drafter training for large language models."""

__version__ = "0.1.0"
