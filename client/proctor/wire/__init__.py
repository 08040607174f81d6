"""The HTTP schema both sides speak, owned by neither: the dataserver's requests and answers (``dataserver``:
/sample, /grade, /meta and the rest) and the experience store's (``experience``: /experience). The server
validates with these models and the client builds and reads with them; none imports a web framework.
"""

from __future__ import annotations

__all__: list[str] = []
