"""One exception type for bad user input, so every entry point can turn it into `error: ...` + exit 2."""


class UserError(Exception):
    """Bad input from the user: the message names the problem and the fix, on one line."""

    exit_code = 2
