"""The one exception type for mistakes a user can fix (config, paths, hardware)."""


class UserError(Exception):
    """A bad input. The message says what is wrong and how to fix it; entry points print it as one line."""
