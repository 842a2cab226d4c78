"""Test and chaos helpers that ship with qworker (standard library only; ``kafka_edge``
needs ``cryptography`` for its test certificates)."""
