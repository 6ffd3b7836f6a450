"""The one exception type for mistakes a user can fix (config, paths, hardware), and how it ends a process."""

import sys
from typing import NoReturn


class UserError(Exception):
    """A bad input. The message says what is wrong and how to fix it; entry points print it as one line."""

    def __init__(self, message: str = "") -> None:
        # Raised in a DataLoader worker, it is rebuilt in the main process from a text with the worker's
        # traceback ("Caught UserError in DataLoader worker process 0. Original Traceback ..."): keep the message.
        if message.startswith("Caught ") and "Original Traceback" in message:
            message = message.rstrip().splitlines()[-1].split("UserError: ", 1)[-1]
        super().__init__(message)


def exit_with(error: UserError) -> NoReturn:
    """`error: <message>` on stderr and exit code 2: how every refused run ends. SystemExit, unlike an
    exception, also passes through code that turns exceptions into warnings (Hydra's callbacks)."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)


def user_error_in(error: BaseException) -> UserError | None:
    """A UserError raised inside a resolver or a Hydra callback arrives wrapped by OmegaConf or Hydra."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, UserError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
