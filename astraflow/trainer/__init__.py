"""The trainer: ``batches.<policy>`` in, versioned weights on ``weights.<policy>`` out.

``loss`` (group advantages, clipped/truncated policy loss; pure torch), ``trainer``
(``Trainer.train_step`` on a Hugging Face causal LM), ``service`` (the Kafka process:
one transaction per version with manifests and consumed offsets; exact resume), ``cli``
(``astraflow trainer run``). Submodules are imported on use (torch is slow to import).
"""
