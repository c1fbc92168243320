"""Many chips: one model across several devices, one process per device (`--parallel`).

`spec.py` reads a parallel spec (``ddp:2``, ``fsdp:2``, ``tp:2``, ``fsdp:2,tp:2``) and groups a fleet's devices;
`launch.py` is the worker's side of one model's parallel step (the model and inputs saved for the ranks, the
rank processes started, rendezvoused and supervised: a rank that crashes or hangs is named and the others
stopped); `rank.py` is one rank (load, wrap for DDP / FSDP2 / tensor parallel, the mode's step, its outputs
gathered whole on the CPU); `wrap.py` the wrapping. The verdict stays the pipeline's: the parallel step's
outputs are judged against the single-device CPU reference and the fp64 oracle like any target's.
"""
