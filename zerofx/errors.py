"""The one exception type users see from zerofx for bad input or a broken invariant."""


class ZeroFXError(RuntimeError):
    """Raised for input zerofx cannot work with; the message says what to change."""
