"""A load balancer in front of several ``proctor serve`` processes, for the tests and benchmarks of replicas:
Debian's nginx (``apt-get install nginx-light``) on a free loopback port, round-robin over the given servers,
trying the next server when one refuses the connection or answers 502 or 503 (proctor's requests may be sent
again: a batch is decided once, a grade counted once). The configuration is the one ``docs/deploying.md``
shows, with this run's ports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from proctor.cli.launcher import free_port

__all__ = ["balancer", "nginx_config", "nginx_main"]


def nginx_config(upstreams: Sequence[str], listen: str) -> str:
    """The ``http`` block of an nginx configuration that balances ``upstreams`` (``host:port``) on ``listen``."""
    servers = "\n".join(f"    server {u} max_fails=0;" for u in upstreams)
    return f"""http {{
  access_log off;
  upstream proctor {{
{servers}
    keepalive 16;
  }}
  server {{
    listen {listen};
    keepalive_requests 1000000;
    client_max_body_size 8m;
    client_body_buffer_size 8m;
    proxy_connect_timeout 2s;
    proxy_read_timeout 600s;
    proxy_max_temp_file_size 0;
    location / {{
      proxy_pass http://proctor;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_next_upstream error timeout http_502 http_503 non_idempotent;
    }}
  }}
}}
"""


def nginx_main(http: str, *, error_log: str = "stderr", head: str = "") -> str:
    """A whole nginx configuration around an ``http`` block (:func:`nginx_config`); ``head``, more main
    directives."""
    return f"{head}worker_processes 1;\nerror_log {error_log} warn;\nevents {{}}\n{http}"


@contextmanager
def balancer(upstreams: Sequence[str]) -> Iterator[str]:
    """nginx balancing ``upstreams`` (``host:port``); yields its URL, and stops it on the way out."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise RuntimeError("the load balancer is Debian's nginx: apt-get install nginx-light")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="proctor-balancer-") as tmp:
        folder = Path(tmp)
        log = folder / "error.log"
        temp = "\n".join(
            f"{kind}_temp_path {folder / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        http = nginx_config(upstreams, f"127.0.0.1:{port}").replace("http {\n", "http {\n" + temp + "\n", 1)
        user = "user root;\n" if os.geteuid() == 0 else ""
        (folder / "nginx.conf").write_text(
            nginx_main(http, error_log=str(log), head=f"{user}pid {folder / 'nginx.pid'};\n")
        )
        proc = subprocess.Popen(
            [nginx, "-p", str(folder), "-c", str(folder / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    said = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"nginx exited with {proc.returncode}: {said}")
                try:
                    httpx.get(url + "/healthz", timeout=5)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
