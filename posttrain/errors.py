"""The exception types the CLI reports in one line, without a traceback.

`UserError`: a problem in what the user gave us (config, data, model paths); exit code 2, the
message names the key, file and line or value, and a traceback would only bury it. `RunStopped`: a
run that stopped on purpose (workers lost beyond what recovery allows); exit code 3. Everything
else (bugs, a crashed worker the run could not recover from) keeps its traceback.
"""


class UserError(ValueError):
    """Bad input: the message alone tells the user what to fix."""


class DataError(UserError):
    """Bad data: the message names the file (or data set) and the line or row."""


class RunStopped(RuntimeError):
    """A run that stopped on purpose, for the reason its message gives in one line: workers died
    more often than `cluster.max_restarts` allows, or could not be rebuilt (`posttrain.distributed.recovery`).
    The CLI prints it without a traceback and exits with code 3; the last checkpoint is whole."""
