"""Stage 2, run: one model on reference and target, many models under supervision.

`pipeline` runs one model (load -> reference -> oracle -> target -> compare -> localize), `compare`
and `localize` judge numerics, `worker` hosts the pipeline in a child process, `pool` supervises such
processes, `policy` decides retries and quarantines (pure functions), `runner` is the glue that runs a
list into the store, `zoo` generates the tiny-zoo list with the same pool.
"""
