"""proctor's curriculum dataserver.

Importing this package is cheap and pulls in neither FastAPI nor torch: the client imports the wire models
from :mod:`proctor.wire.dataserver`. Build the service with :func:`proctor.server.app.create_app`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("proctor")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
