"""The one exception type users see from zerofx for bad input or a broken invariant."""


class ZeroFXError(RuntimeError):
    """Raised for input zerofx cannot work with; the message says what to change."""


def some_names(names: list[str], shown: int = 3, sep: str = ", ") -> str:
    """The first ``shown`` of ``names`` for an error message, then how many more there are."""
    more = len(names) - shown
    tail = f" and {more} more" if sep == ", " else f"{sep}and {more} more"  # "a, b and 2 more"; "a; b; and 2 more"
    return sep.join(names[:shown]) + (tail if more > 0 else "")


def first_line(text: str) -> str:
    """An error message's first line; for an error dynamo wraps (``BackendCompilerFailed:
    backend=... raised:``, with the cause on the next line: a ZeroFXError from zerofx's compile)
    the cause's."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith("raised:"):
        return lines[1]
    return lines[0] if lines else ""
