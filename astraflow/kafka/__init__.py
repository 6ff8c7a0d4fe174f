"""Thin typed wrappers over confluent-kafka and the processor runtime."""

from astraflow.kafka.table import Entry, TopicReader, TopicTable

__all__ = ["Entry", "TopicReader", "TopicTable"]
