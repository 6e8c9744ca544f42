"""Test helpers shipped with regen (fault-injection stubs, not replacements for the real parts)."""
