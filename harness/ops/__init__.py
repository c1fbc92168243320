"""Op variations: the kernel worklist's harvest, signatures, and the run of one variation on the target.

`signature` (a call as a variation, and its inputs regenerated), `harvest` (the variations a model's
reference step calls), `variation` (one variation on the target, judged by the op check's rule),
`opinfo` (PyTorch's OpInfo samples of the ops a list uses, as variations), `jobs` (a run's variations).
"""
