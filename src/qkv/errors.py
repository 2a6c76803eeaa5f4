"""The one exception type that the CLI turns into a single line and exit code 2."""


class QkvError(ValueError):
    """A problem with the user's input (a file, an option, a shape) that they can fix.

    It subclasses ValueError so library users can catch it the usual way; the message
    names what is wrong and, where possible, what to do instead.
    """
