"""Roles of the multi-policy workflows: verifier and selector beside the solver.

The tiny model (256 positions) needs compact prompts, so each role has a one-line format
built from the arithmetic prompt (``"37+45="``) and the solver's answer(s):

================  ============================  ==========================================
role              prompt                        completion
================  ============================  ==========================================
solver            ``37+45=``                    ``82`` (the arithmetic format)
verifier          ``37+45=82?``                 ``82y`` / ``73n``: its own answer, then
                                                ``y`` (approve) or ``n`` (reject)
blind verifier    ``37+45=``, then ``73?``      ``82|`` (its own answer, first turn), then
                                                ``n`` after the candidate (second turn)
solver, retry     ``37+45=82?n 37+45=``         a new answer, e.g. ``83``
selector          ``37+45=82|83>``              ``82:1``: its own answer, then ``1`` or
                                                ``2`` (the answer it picks)
================  ============================  ==========================================

The judges recompute, then judge: their own answer comes first (optional for the parsers),
because the tiny model does not learn a bare verdict. The blind verifier answers before
it sees the candidate, so it cannot copy it. The measurements behind both choices are in
docs/multi-policy.md.

* ``formats``: the prompts above and their parsers.
* ``teacher``: wrong answers and the fallible teacher's warm-start examples.
* ``scoring``: held-out role examples and the role accuracy (``astraflow eval run --role``).
* ``warm_start``: ``init_role_model``, a tiny model warm-started on a role's format.
* ``cli``: ``astraflow model init-role``.
"""
