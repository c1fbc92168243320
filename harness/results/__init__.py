"""Stage 3, results: the typed row contract and the embedded SQLite store.

`rows` (what a worker measures, what the store keeps), `store` (one durable row per model x target x
settings), `codec` (rows <-> SQLite <-> pandas), `dbfile` (refuse files that are not ours), `merge`
(shard DBs -> one night).
"""
