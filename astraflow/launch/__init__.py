"""``astraflow up`` and ``down``: the processes of a run (``plan``), the models they need
(``provision``), starting and supervising them (``up``, ``supervisor``, ``actuator``), live
progress and the summary (``progress``, ``plots``, ``status``), runs on a cluster
(``runs``), the secured mode (``secure``) and the exactly-once books (``audit``)."""
