"""The wire format: typed records (``records``), their Avro schemas (``schemas``) and codec
(``codec``), and the semantic checks of a decoded record (``validate``)."""
