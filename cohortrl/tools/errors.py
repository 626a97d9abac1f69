"""The error a failed tool call raises. It lies below every other module of the package: the protocol
(``base.py``) imports the built-in tools, and they raise it."""


class ToolError(ValueError):
    """A failed call, its message written for the model, which reads it as the call's result."""
