"""Stage 2, run: one model, judged. `pipeline` runs it (load -> reference side -> target -> compare ->
explain a drift), `compare` and `localize` judge numerics, `attribution` says whose fault an error is.
Running many models under supervision is `harness.fleet`'s job.
"""

# The modes a run can take and generate's options, as the CLI offers them without importing torch;
# `harness.run.modes` implements exactly these (it checks), `harness.run.generate` decodes with them.
MODE_NAMES = ("inference", "train", "generate")
NEW_TOKENS = 8  # generate: tokens decoded per row
KV_CACHES = ("dynamic", "static")  # generate: transformers' DynamicCache (default), StaticCache
