"""``did you mean protocol.fragments?``: the closest name to a mistyped one (``--set`` keys and
sections, in one line). A ``--set`` typo listed every key of its section and suggested none."""

from __future__ import annotations

import difflib


def did_you_mean(wrong: str, candidates: list[str], what: str, listed: list[str] | None = None) -> str:
    """``: did you mean X?`` for the closest candidate, else the list a user picks from (``listed``,
    default the candidates). For ``section.key``: a typo of a key of that section, else the same
    key (or a typo of it) under another section (``train.fragments``: ``protocol.fragments``)."""
    if "." in wrong:
        section, key = wrong.split(".", 1)
        by_key: dict[str, list[str]] = {}
        for c in candidates:
            by_key.setdefault(c.split(".", 1)[1], []).append(c)
        own = [c.split(".", 1)[1] for c in candidates if c.startswith(f"{section}.")]
        close = [f"{section}.{k}" for k in difflib.get_close_matches(key, own, n=1, cutoff=0.75)]
        close = close or [by_key[k][0] for k in difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.75)]
    else:
        close = difflib.get_close_matches(wrong, candidates, n=1, cutoff=0.6)
    if close:
        return f": did you mean {close[0]}?"
    return f" ({what}: {', '.join(listed if listed is not None else candidates)})"
