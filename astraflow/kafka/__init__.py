"""Thin typed wrappers over confluent-kafka, the client configuration, and the one
transactional loop every component runs (the processor runtime is ``astraflow.dataflow``)."""

from astraflow.kafka.table import Entry, TopicReader, TopicTable

__all__ = ["Entry", "TopicReader", "TopicTable"]
