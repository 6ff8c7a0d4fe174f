"""Thin typed wrappers over confluent-kafka and the processor runtime."""
