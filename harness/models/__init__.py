"""Stage 1, models: which models to run and how to build, load and feed them.

`model_list` (CSV lists), `heads` (task -> Auto class), `shrink` + `tiny` (toy-size builds of every
architecture), `load` (tiny, hub, local checkpoints -> a CPU model), `configs`, `inputs` (seeded inputs
per modality) and `outputs` (named output tensors).
"""
