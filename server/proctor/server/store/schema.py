"""The state's tables, their version, and the migrations from older versions."""

from __future__ import annotations

__all__ = ["MIGRATE_1_TO_2", "MIGRATE_2_TO_3", "MIGRATE_3_TO_4", "MIGRATE_4_TO_5", "SCHEMA", "SCHEMA_VERSION"]

SCHEMA_VERSION = 5

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS iterations (
    iteration INTEGER PRIMARY KEY,
    batch_size INTEGER NOT NULL,
    stage INTEGER NOT NULL,
    samples TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY,
    iteration INTEGER NOT NULL,
    from_stage INTEGER NOT NULL,
    to_stage INTEGER NOT NULL,
    reason TEXT NOT NULL,
    rolling_reward REAL,
    rolling_count INTEGER,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS grades (
    seq INTEGER PRIMARY KEY,
    iteration INTEGER NOT NULL,
    sample_id TEXT NOT NULL,
    slot INTEGER NOT NULL,
    completion_index INTEGER NOT NULL,
    completion_sha TEXT NOT NULL,
    stage INTEGER NOT NULL,
    source TEXT NOT NULL,
    reward REAL NOT NULL,
    components TEXT NOT NULL,
    error TEXT,
    created_at REAL NOT NULL,
    details TEXT,
    UNIQUE (iteration, sample_id, slot, completion_index, completion_sha)
);
CREATE INDEX IF NOT EXISTS grades_by_stage ON grades (stage, seq);
-- The latest iteration that served each sample id: /grade without `iteration` attributes by it.
CREATE TABLE IF NOT EXISTS served (
    sample_id TEXT PRIMARY KEY,
    iteration INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS grades_errors ON grades (seq) WHERE error IS NOT NULL;
-- Per-record state of the finite sources (proctor.server.state.items), folded in with the grades.
CREATE TABLE IF NOT EXISTS items (
    source TEXT NOT NULL,
    key INTEGER NOT NULL,
    passes REAL NOT NULL DEFAULT 0,
    fails REAL NOT NULL DEFAULT 0,
    groups INTEGER NOT NULL DEFAULT 0,
    streak INTEGER NOT NULL DEFAULT 0,
    streak_before INTEGER NOT NULL DEFAULT 0,
    last_iteration INTEGER NOT NULL DEFAULT -1,
    last_slot INTEGER NOT NULL DEFAULT -1,
    served_epoch INTEGER NOT NULL DEFAULT -1,
    PRIMARY KEY (source, key)
) WITHOUT ROWID;
-- One prompt's graded completions at one iteration: count, mean reward, Welford's sum of squares.
CREATE TABLE IF NOT EXISTS groups (
    iteration INTEGER NOT NULL,
    sample_id TEXT NOT NULL,
    slot INTEGER NOT NULL,
    n INTEGER NOT NULL,
    mean REAL NOT NULL,
    m2 REAL NOT NULL,
    PRIMARY KEY (iteration, sample_id, slot)
) WITHOUT ROWID;
-- What an adaptive stage decided for an iteration, and the samplers' state after it.
CREATE TABLE IF NOT EXISTS decisions (
    iteration INTEGER PRIMARY KEY,
    stage INTEGER NOT NULL,
    sampler TEXT NOT NULL,
    state TEXT NOT NULL,
    detail TEXT NOT NULL
);
-- A step's refill rounds (POST /refill): the rule, and which groups each round replaced by which slot. The
-- replacing samples are appended to the step's `iterations.samples`, past its batch_size.
CREATE TABLE IF NOT EXISTS refills (
    iteration INTEGER NOT NULL,
    round INTEGER NOT NULL,
    detail TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (iteration, round)
);
"""

# Version 1 keyed grades without a slot and kept no served index; both are rebuilt from what it stored.
MIGRATE_1_TO_2 = (
    """
ALTER TABLE grades RENAME TO grades_v1;
DROP INDEX IF EXISTS grades_by_stage;
"""
    + SCHEMA
    + """
INSERT INTO grades (seq, iteration, sample_id, slot, completion_index, completion_sha, stage, source, reward,
                    components, error, created_at)
    SELECT seq, iteration, sample_id, -1, completion_index, completion_sha, stage, source, reward, components,
           error, created_at FROM grades_v1;
DROP TABLE grades_v1;
INSERT INTO served (sample_id, iteration)
    SELECT json_extract(s.value, '$.sample_id'), MAX(i.iteration) FROM iterations AS i, json_each(i.samples) AS s
    GROUP BY 1;
UPDATE meta SET value = '2' WHERE key = 'schema_version';
"""
)

# Version 2 had no per-record state: the new tables start empty (the grades before them are not folded in).
MIGRATE_2_TO_3 = SCHEMA + "UPDATE meta SET value = '3' WHERE key = 'schema_version';"

# Version 3 had no refills: the table starts empty.
MIGRATE_3_TO_4 = SCHEMA + "UPDATE meta SET value = '4' WHERE key = 'schema_version';"

# Version 4 kept no graders' details: its grades have none (NULL). The column comes last, where ALTER TABLE adds it.
MIGRATE_4_TO_5 = SCHEMA + "UPDATE meta SET value = '5' WHERE key = 'schema_version';"
