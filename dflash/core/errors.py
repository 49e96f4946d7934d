"""The one error type users see: a single actionable line naming the file, field or flag."""


class DFlashError(Exception):
    """An input problem the user can fix. The message is one line: what, where, and what was expected."""
