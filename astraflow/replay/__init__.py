"""Offline replay of a run's retained topics: ranges and export (``ranges``), a processor
chain run again (``process``), a policy trained again (``train``)."""
