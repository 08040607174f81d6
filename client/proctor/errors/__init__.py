"""The root of every error proctor raises, on either side of the wire.

The dataserver's errors (``proctor.server.exceptions``), the client's (``proctor.client.errors``) and the
experience store's (``proctor.experience.errors``) all derive from :class:`ProctorError`, so a trainer that
talks to the dataserver and the store needs one ``except`` clause. No class here knows HTTP: the server's
HTTP layer chooses each answer's status, and the client's turns a status back into a class.
"""

from __future__ import annotations

__all__ = ["ProctorError"]


class ProctorError(Exception):
    """Every error proctor raises."""
