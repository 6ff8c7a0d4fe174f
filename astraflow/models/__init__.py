"""Policy models: local Hugging Face causal LMs, the tiny CPU model, warm start, evaluation.

* ``errors``: ``ModelError``, the one error of this package.
* ``loading``: check and load any local Hugging Face causal LM (offline, local files only).
* ``tiny``: the tiny Llama-architecture model with a character-level tokenizer.
* ``examples``: supervised examples (prompt, answer, eos) as token ids and loss masks.
* ``warm_start``: the short supervised fine-tune before RL.
* ``evaluation``: greedy, batched generation and accuracy.
* ``sampling``: the sampling distribution (temperature, top-p) the engines sample from and
  the trainer computes its log-probs of.
* ``recipe``: what made a model (``astraflow_init.json``), for ``astraflow up``.
* ``cli``: the ``model init`` and ``model import`` commands.
"""

import os

# Nothing is ever downloaded: set before any submodule imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
