"""Errors caused by user input (config, data, paths): the CLI prints them without a traceback."""


class UserError(Exception):
    """Something the user can fix; the message says what and how."""
