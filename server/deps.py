"""Dependencies shared by the routes, as ``Annotated`` aliases."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from proctor.server.service import Dataserver
from proctor.server.settings import Settings

__all__ = ["DataserverDep", "SettingsDep", "require_api_key"]


# async, although they do not await: FastAPI runs plain `def` dependencies in a worker thread, which would
# cost three thread hops on every request.
async def get_dataserver(request: Request) -> Dataserver:
    server: Dataserver = request.state.dataserver
    return server


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.state.settings
    return settings


DataserverDep = Annotated[Dataserver, Depends(get_dataserver)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

_bearer = HTTPBearer(auto_error=False)


async def require_api_key(
    settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """With ``PROCTOR_API_KEY`` set, the request must carry ``Authorization: Bearer <key>``."""
    if settings.api_key is None:
        return
    expected = settings.api_key.get_secret_value()
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="Authorization: missing; this server requires the header 'Authorization: Bearer <PROCTOR_API_KEY>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="Authorization: the bearer token does not match this server's PROCTOR_API_KEY",
            headers={"WWW-Authenticate": "Bearer"},
        )
