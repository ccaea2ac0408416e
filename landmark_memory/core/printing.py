"""Text from documents, names and models as a terminal shows it: as text, never as commands.

A document, a file name or a model's folder may hold a terminal's escape sequences (``ESC ]0;``
sets a window's title) or Unicode's direction controls (``report<U+202E>exe.txt`` shows as
``reporttxt.exe``). Every command prints such text through ``printable`` (or ``json_text`` with
``--json``), which writes those characters as escapes a reader sees."""

import json
import re

# C0 and C1 control characters but new lines and tabs, and the bidirectional marks, embeddings,
# overrides and isolates (U+061C, U+200E-F, U+202A-E, U+2066-9)
UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with its control and direction characters written as escapes (``\\x1b``,
    ``\\u202e``), safe to show on a terminal."""
    return UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def json_text(doc, **dumps) -> str:
    """``doc`` as JSON with its text readable (non-ASCII letters as they are) and no character
    that ``printable`` escapes left raw: JSON escapes them (``\\u202e``) as it does line breaks."""
    return UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(doc, ensure_ascii=False, **dumps))
