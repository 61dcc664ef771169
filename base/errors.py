"""The one base class of every error a user can cause.

Each room raises its own subclass (``ResourceError``, ``StoreError``,
``TrainError``, ``RegistryError``, ...) with a message that names the input
and says what to change. A command catches :class:`UserError` once and prints
that message as one line; anything else is a bug and keeps its traceback.
It is deliberately not a ``ValueError``: a bug that raises ``ValueError``
must not pass for a user's mistake.
"""


class UserError(Exception):
    """Something the user can fix; the message says what to change."""
