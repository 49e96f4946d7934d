"""The errors users see: a single actionable line naming the file, field or flag (SettingError: a setting, which
the CLI names by its flag and the server by its field)."""

import difflib


class DFlashError(Exception):
    """An input problem the user can fix. The message is one line: what, where, and what was expected."""


class SettingError(DFlashError):
    """A setting's value refused. `field` is its name in Python (top_p): the server answers with it as the JSON
    field, and the error reads as the CLI's flag (--top-p: got 2.0, expected a value in (0, 1])."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{self.flag}: {message}")

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the choice closest to word, case ignored (a typo, a missing digit, SmolLM2 for
    smollm2), else ''."""
    by_lower = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[match[0]]}?)" if match else ""
