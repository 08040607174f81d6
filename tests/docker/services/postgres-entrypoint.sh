#!/bin/sh
# What the official postgres image does with POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB, on Debian's
# PostgreSQL 15: a new data directory gets that user (password-checked over the network) and that database;
# then the server runs in the foreground, listening on every address of the container.
set -eu
data=/var/lib/postgresql/data
mkdir -p "$data" /var/run/postgresql
chown postgres:postgres "$data" /var/run/postgresql
chmod 700 "$data"
if [ ! -s "$data/PG_VERSION" ]; then
    printf '%s\n' "$POSTGRES_PASSWORD" > /tmp/pwfile
    chown postgres /tmp/pwfile
    runuser -u postgres -- initdb -D "$data" -U "$POSTGRES_USER" --pwfile=/tmp/pwfile \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f /tmp/pwfile
    echo "host all all all scram-sha-256" >> "$data/pg_hba.conf"
    runuser -u postgres -- pg_ctl -D "$data" -o "-c listen_addresses=''" -w start >/dev/null
    runuser -u postgres -- psql -q -U "$POSTGRES_USER" -d postgres -c "CREATE DATABASE \"$POSTGRES_DB\""
    runuser -u postgres -- pg_ctl -D "$data" -m fast -w stop >/dev/null
fi
exec runuser -u postgres -- postgres -D "$data" -c listen_addresses='*'
