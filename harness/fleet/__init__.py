"""Stage 3, fleet: many models under supervision.

`runner` runs a list into the store (the glue), `runconfig` holds a run's settings and their ranges,
`executor` picks where workers come from, `pool` supervises worker processes on this host and
`raypool` + `rayactor` the same on a Ray cluster, `worker` hosts one model's pipeline
(`harness.run.pipeline`) in a child process, `policy` decides retries, strikes, quarantines and spares
(pure functions), `quiet` keeps a timed step alone on its host, `zoo` generates the tiny-zoo list with
the same pool.
"""
