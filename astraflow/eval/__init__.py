"""Held-out evaluation of published weight versions (``astraflow eval run``)."""
