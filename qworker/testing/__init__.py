"""Test and chaos helpers that ship with qworker (standard library only)."""
