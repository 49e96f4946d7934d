"""The one error type users see: a single actionable line naming the file, field or flag."""

import difflib


class DFlashError(Exception):
    """An input problem the user can fix. The message is one line: what, where, and what was expected."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the choice closest to word, case ignored (a typo, a missing digit, SmolLM2 for
    smollm2), else ''."""
    by_lower = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[match[0]]}?)" if match else ""
