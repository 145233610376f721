"""Errors caused by user input (config, data, paths): the CLI prints them without a traceback.

They live here, in a module that imports nothing, so any layer (config, data, engines) can raise
them without importing another layer.
"""


class UserError(Exception):
    """Something the user can fix; the message says what and how."""


class ConfigError(UserError, ValueError):
    """A config problem, phrased so the user can fix it without reading our code."""


class DataError(UserError, ValueError):
    """Bad input data; the message names the file, the line and the fix."""
