"""``python -m bench``: every benchmark, one after the other, each printing its table."""

from __future__ import annotations

from bench import server_load

if __name__ == "__main__":
    server_load.main()
