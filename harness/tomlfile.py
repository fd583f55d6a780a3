"""Reading TOML that a user or a file supplies: the one edge where its bytes become data.

Every way such input can be wrong ends as one exception of the caller's own type (``error``:
ConfigError, ExperimentError), whose one-line message names what was read and why: a missing
file, a directory or another non-regular file (a FIFO would block the read forever), one that
cannot be read, bytes that are not UTF-8, invalid TOML, an integer of more than 4300 digits, or
nesting deeper than :data:`MAX_DEPTH`. (Deeper still, tomllib raises RecursionError, and so
would any later walk of the data: a deepcopy, a repr in a message.)
"""

from __future__ import annotations

import stat
import tomllib
from pathlib import Path
from typing import Any

#: Deepest nesting of tables and lists accepted; a job config or an experiment needs 3 or 4.
MAX_DEPTH = 32


def parse_toml(text: str, what: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """``tomllib.loads(text)``, or ``error`` naming ``what``. For invalid TOML the error's
    ``__cause__`` is the TOMLDecodeError (an override falls back to a bare word on it only)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what} is not valid TOML: {e}") from e
    except ValueError as e:  # int() refuses more than 4300 digits
        raise error(f"{what}: {e}") from None
    except RecursionError:
        raise error(f"{what}: nested deeper than {MAX_DEPTH} tables or lists") from None
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:  # by hand, not by recursion: recursion is what deep data breaks
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise error(f"{what}: nested deeper than {MAX_DEPTH} tables or lists")
        if isinstance(value, dict):
            stack.extend((child, depth + 1) for child in value.values())
        elif isinstance(value, list):
            stack.extend((child, depth + 1) for child in value)
    return data


def read_toml(path: str | Path, what: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The UTF-8 TOML file at ``path``, or ``error`` naming ``what`` and ``path`` (see the
    module docstring for every case)."""
    where = f"{what} {str(path)!r}"
    try:
        regular = stat.S_ISREG(Path(path).stat().st_mode)
        text = Path(path).read_text(encoding="utf-8") if regular else None
    except FileNotFoundError:
        raise error(f"{where} does not exist") from None
    except OSError as e:  # permission denied, a name too long, an I/O error
        raise error(f"{where} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{where} is not UTF-8 text (at byte {e.start})") from None
    except ValueError as e:  # a path with a NUL byte
        raise error(f"{where}: {e}") from None
    if text is None:
        raise error(f"{where} is not a regular file (a directory?)")
    return parse_toml(text, where, error)
