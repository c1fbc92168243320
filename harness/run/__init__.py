"""Stage 2, run: one model, judged. `pipeline` runs it (load -> reference side -> target -> compare ->
explain a drift), `compare` and `localize` judge numerics, `attribution` says whose fault an error is.
Running many models under supervision is `harness.fleet`'s job.
"""
