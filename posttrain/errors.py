"""The one exception type for problems in what the user gave us (config, data, model paths).

The CLI prints a `UserError` as one line, exits with code 2 and shows no traceback: the message
names the key, file and line or value, and a traceback would only bury it. Everything else
(bugs, crashed workers) keeps its traceback.
"""


class UserError(ValueError):
    """Bad input: the message alone tells the user what to fix."""


class DataError(UserError):
    """Bad data: the message names the file (or data set) and the line or row."""
