#!/usr/bin/env bash
# Installs Docker Compose v2 (`docker compose`) from Debian's own package where the release in use packages only
# v1 (`docker-compose` 1.29 on bookworm): trixie's docker-compose package holds v2 as a CLI plugin, a static
# binary. It goes to /usr/local/lib/docker/cli-plugins, beside whatever else is installed. Needs root and curl.
#   docker/compose-v2.sh && docker compose version
set -euo pipefail
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
release=${COMPOSE_RELEASE:-trixie}
arch=$(dpkg --print-architecture)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsS -o "$work/Packages.xz" "$mirror/dists/$release/main/binary-$arch/Packages.xz"
xz -d "$work/Packages.xz"
file=$(awk '/^Package: docker-compose$/ {found=1} found && /^Filename:/ {print $2; exit}' "$work/Packages")
[ -n "$file" ] || { echo "no docker-compose package in $release" >&2; exit 1; }
curl -fsS -o "$work/compose.deb" "$mirror/$file"
dpkg-deb -x "$work/compose.deb" "$work/root"
install -D -m 0755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose
docker compose version
