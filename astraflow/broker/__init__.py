"""The embedded Apache Kafka: a single KRaft node (``embedded``), secured (``secure``), a
cluster of nodes (``cluster``), the server properties they share (``properties``), and
broker faults (``faults``)."""
