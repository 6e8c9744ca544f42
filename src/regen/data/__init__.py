"""Data files shipped with regen (the embedded default's prompt set)."""
