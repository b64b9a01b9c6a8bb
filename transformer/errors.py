"""The one exception type a user sees as a one-line message instead of a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, arguments).

    The CLI prints ``error: <message>`` and exits with status 2; nothing else
    in the package catches it.
    """
