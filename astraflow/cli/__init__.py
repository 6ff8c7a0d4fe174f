"""The ``astraflow`` command: one module per noun, each with ``register(subparsers)``;
``main`` assembles them. The only package that imports argparse."""
