#!/usr/bin/env bash
# Builds a Python 3.11 base image from Debian's packages, for a machine that cannot pull python:3.11-slim
# (no Docker Hub), and builds the dataserver on it:
#   docker/debian-base.sh proctor-base:bookworm
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=proctor-base:bookworm -t proctor .
# Needs root, debootstrap and a Docker engine. The host's locally added CA certificates go into the image, so
# that pip there trusts what the host trusts (an egress proxy's certificate, say).
set -euo pipefail
tag=${1:-proctor-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror" >/dev/null
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# Debian's Python is "externally managed": in an image of one application, pip installs into it all the same.
tar -C "$root" -c . | docker import \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt LANG=C.UTF-8' \
    --change 'CMD ["python"]' - "$tag" >/dev/null
echo "$tag"
