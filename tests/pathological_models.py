"""Build local, remote-code Hugging Face models that misbehave on the target device only.

Real fleets meet models whose custom code segfaults a driver, spins forever or allocates without
bound. These are real `save_pretrained` checkpoints with their own modelling code (`auto_map`,
loaded with `trust_remote_code=True`): the reference run on CPU is fine, the target run is not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

CONFIG_PY = '''
from transformers import PretrainedConfig


class PathoConfig(PretrainedConfig):
    model_type = "patho"

    def __init__(self, behaviour="none", hidden_size=16, vocab_size=64, **kwargs):
        self.behaviour = behaviour
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        super().__init__(**kwargs)
'''

MODELING_PY = '''
import os
import signal
import time

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from .configuration_patho import PathoConfig

try:  # an op without a fake (meta) implementation: it runs eagerly anywhere, Dynamo cannot trace it
    @torch.library.custom_op("patho::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2
except RuntimeError:  # defined already (another copy of this file in the process)
    twice = torch.ops.patho.twice


class PathoModel(PreTrainedModel):
    config_class = PathoConfig
    base_model_prefix = "patho"

    def __init__(self, config):
        super().__init__(config)
        if config.behaviour.startswith("slow-load") and not os.environ.get("PATHO_BUILDING"):
            time.sleep(float(config.behaviour.partition(":")[2] or 3600))  # loading, not running, is slow
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        b = self.config.behaviour
        if b == "noisy-train" and self.training:  # randomness no dropout switch reaches
            return BaseModelOutput(last_hidden_state=self.proj(self.embed(input_ids) + 1e-3 * torch.rand(1)))
        if b == "detach-grad" and input_ids.device.type != "cpu":  # the target loses proj.weight's gradient
            h = self.embed(input_ids)
            return BaseModelOutput(last_hidden_state=h @ self.proj.weight.detach().t() + self.proj.bias)
        if b == "no-fake":  # compiled, Dynamo fails (no fake impl); eagerly it runs anywhere
            return BaseModelOutput(last_hidden_state=twice(self.proj(self.embed(input_ids))))
        if b == "graph-break":  # a data-dependent Python branch: Dynamo breaks the graph at .item()
            h = self.proj(self.embed(input_ids))
            return BaseModelOutput(last_hidden_state=h * 2 if h.sum().item() > 0 else h)
        if b == "noisy" and input_ids.device.type != "cpu":  # prints from Python and below it, then behaves
            print("noisy: a line on stdout", flush=True)
            import sys  # as warnings.showwarning writes (a test runner records real warnings instead)
            print("noisy: a UserWarning on sys.stderr", file=sys.stderr)
            os.write(2, b"noisy: USDT-like line from native code\\n")
        if b == "norm":  # a well-behaved model with a layer norm
            h = self.proj(self.embed(input_ids))
            return BaseModelOutput(last_hidden_state=torch.nn.functional.layer_norm(h, h.shape[-1:]))
        if b == "oom-ref":  # too big everywhere: the CPU reference exhausts a capped worker's allocator
            torch.empty(2**33, dtype=torch.uint8, device=input_ids.device)
        if b == "kill-device-once" and input_ids.device.type != "cpu":
            mark = os.path.join(self.config._name_or_path, "killed-once")
            if not os.path.exists(mark):  # its first target run kills the device (touches PATHO_KILL_FILE)
                open(mark, "w").close()
                open(os.environ["PATHO_KILL_FILE"], "w").close()
                time.sleep(1.0)  # long enough for a device server to notice and go
        if b.startswith("crash-once") and input_ids.device.type != "cpu":
            mark = os.path.join(self.config._name_or_path, "crashed-once")
            if not os.path.exists(mark):  # its first target run segfaults; later ones reach a cumsum
                open(mark, "w").close()
                os.kill(os.getpid(), signal.SIGSEGV)
            return BaseModelOutput(last_hidden_state=torch.cumsum(self.proj(self.embed(input_ids)), 1))
        if input_ids.device.type != "cpu":
            b = self.config.behaviour
            if b == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif b == "hang":
                time.sleep(3600)
            elif b == "oom":
                torch.empty(2**33, dtype=torch.uint8, device=input_ids.device)  # 8 GiB: only a cap stops it
        return BaseModelOutput(last_hidden_state=self.proj(self.embed(input_ids)))
'''


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def build(root: Path, behaviour: str) -> Path:
    """Write a checkpoint dir whose model misbehaves (`crash`, `hang`, `oom`, `none`) off the CPU, takes
    long to load (`slow-load:SECONDS`, an hour without SECONDS), or in train mode draws random numbers
    (`noisy-train`) or loses a gradient on the target (`detach-grad`); `norm` ends in a layer norm;
    `oom-ref` allocates 8 GiB on every device, the CPU included; `crash-once[:tag]` segfaults on its
    first run off the CPU, then computes a cumsum (which the toy backend lacks); `kill-device-once`
    creates the file named by PATHO_KILL_FILE on its first run off the CPU (a device's dead file, or its
    server's kill file), then behaves; `no-fake` calls an op Dynamo cannot trace (no fake impl) and
    `graph-break` branches on a tensor's value (compiled, they fail in Dynamo's trace and break the graph);
    `noisy` prints on stdout, warns and writes to fd 2 (as native code does) off the CPU, then behaves."""
    import torch

    d = root / f"patho-{behaviour.replace(':', '-')}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "configuration_patho.py").write_text(CONFIG_PY)
    (d / "modeling_patho.py").write_text(MODELING_PY.replace("from .configuration_patho", "from configuration_patho"))
    sys.path.insert(0, str(d))
    os.environ["PATHO_BUILDING"] = "1"
    try:
        cfg_mod = _load_module(d / "configuration_patho.py", "configuration_patho")
        model_mod = _load_module(d / "modeling_patho.py", f"modeling_patho_{behaviour}")
        cfg = cfg_mod.PathoConfig(behaviour=behaviour)
        torch.manual_seed(0)
        model = model_mod.PathoModel(cfg)
        model.save_pretrained(d)
    finally:
        os.environ.pop("PATHO_BUILDING", None)
        sys.path.remove(str(d))
        sys.modules.pop("configuration_patho", None)
    # The shipped code uses the relative import transformers' dynamic-module loader expects.
    (d / "modeling_patho.py").write_text(MODELING_PY)
    conf = json.loads((d / "config.json").read_text())
    conf["auto_map"] = {"AutoConfig": "configuration_patho.PathoConfig", "AutoModel": "modeling_patho.PathoModel"}
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    return d


def list_rows(dirs: dict[str, Path]) -> str:
    """Model-list CSV rows (no header) for built checkpoints, keyed by id."""
    return "".join(
        f"{mid},local,patho,base,text,,,,true,,,{path}\n" for mid, path in dirs.items()
    )
