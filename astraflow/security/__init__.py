"""Least-privilege ACLs of a topology (``acls``) and their apply (``acls_apply``), and the
private certificate authority of a secured broker (``tls``). Client-side security settings
are ``astraflow.kafka.security``; signed weight manifests are ``astraflow.weights.signing``."""
