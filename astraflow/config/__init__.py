"""The typed topology, torch-free and argparse-free: the run definition (``topology``), each
component's section with its defaults (``sections``), workflow, engine and processor options
(``options``, ``processors``), the override flags made from those fields (``overrides``), a
component's effective settings (``components``) and old-format keys (``migrate``)."""
