"""The base of errors whose message says all a user needs (bad config, a missing model
directory, a dataset without a field): the CLI prints them as one line, no traceback."""


class AstraflowError(Exception):
    """An error the command line reports as ``astraflow: <message>`` with exit status 2."""


__all__ = ["AstraflowError"]
