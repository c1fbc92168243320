"""sim's device runtime: per-thread current device, simulated memory (accounting, size, OOM),
streams and events, device properties, storages and data pointers, torch.save/load, and the
native library's build cache.

Subprocess tests cover what is fixed at import time (env vars, building the native library).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import harness.sim as sim
from harness.sim import native


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if (not k.startswith("PORTHARNESS_SIM_") or k == "PORTHARNESS_SIM_NAMESPACE")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout)


# --- current device -------------------------------------------------------------------------------


def test_current_device_is_per_thread_and_shared_with_torch_accelerator():
    seen = {}

    def worker():
        torch.sim.set_device(1)
        seen["thread"] = (torch.sim.current_device(), torch.ones(1, device="sim").device.index)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["thread"] == (1, 1)
    assert torch.sim.current_device() == 0  # another thread's set_device does not move this one
    torch.accelerator.set_device_index(1)
    try:
        assert torch.sim.current_device() == 1
        assert torch.empty(2, device="sim").device == torch.device("sim", 1)
    finally:
        torch.accelerator.set_device_index(0)
    assert torch.accelerator.device_count() == torch.sim.device_count()


# --- memory ---------------------------------------------------------------------------------------


def test_memory_accounting_counts_live_storages_once():
    torch.sim.reset_peak_memory_stats(1)
    base = torch.sim.memory_allocated(1)
    t = torch.empty(1000, device="sim:1")
    assert torch.sim.memory_allocated(1) == base + 4000
    assert torch.accelerator.memory_allocated(1) == base + 4000  # the same numbers, through the allocator
    views = (t[10:], t.view(10, 100), t.t() if t.dim() == 2 else t.unsqueeze(0))
    assert torch.sim.memory_allocated(1) == base + 4000  # views share their base's memory
    u = t * 2  # an op's output is new device memory
    assert torch.sim.memory_allocated(1) == base + 8000
    assert torch.sim.memory_allocated(0) == torch.accelerator.memory_allocated(0)
    del t, u, views
    assert torch.sim.memory_allocated(1) == base
    assert torch.sim.max_memory_allocated(1) == base + 8000
    assert torch.accelerator.max_memory_allocated(1) == base + 8000
    torch.accelerator.reset_peak_memory_stats(1)
    assert torch.sim.max_memory_allocated(1) == base
    stats = torch.accelerator.memory_stats(1)
    assert stats["allocated_bytes.all.current"] == base
    assert torch.sim.memory_stats(1)["allocated_bytes.all.current"] == base
    free, total = torch.accelerator.get_memory_info(1)
    assert (free, total) == torch.sim.mem_get_info(1) and total == torch.sim.get_memory_size(1)


def test_allocations_beyond_the_device_memory_raise_out_of_memory():
    from harness.run.attribution import classify_exception

    base = torch.sim.memory_allocated(1)
    ooms = torch.sim.memory_stats(1)["num_ooms"]
    with sim.memory_size((base + (1 << 20)) / (1 << 20), "sim:1"):  # 1 MiB free on sim:1
        assert torch.sim.get_memory_size(1) == base + (1 << 20)
        a = torch.zeros(150_000, device="sim:1")  # 600 kB fits
        with pytest.raises(torch.OutOfMemoryError, match=r"sim:1 out of memory\. Tried to allocate") as exc:
            torch.empty(150_000, device="sim:1")  # a factory: refused before the host allocates
        with pytest.raises(torch.OutOfMemoryError, match="sim:1 out of memory"):
            a * 2  # an op's output
        with pytest.raises(torch.OutOfMemoryError, match="sim:1 out of memory"):
            torch.zeros(150_000).to("sim:1")
        assert torch.zeros(150_000, device="sim:0").device.index == 0  # other devices keep their size
        del a
        b = torch.ones(150_000, device="sim:1")  # freed memory is available again
        del b
    assert torch.sim.memory_stats(1)["num_ooms"] == ooms + 3
    assert torch.sim.get_memory_size(1) > base + (1 << 20)  # restored after the block
    assert classify_exception(exc.value)["outcome"] == "oom"  # the runner files it as an OOM


def test_memory_size_env_var():
    code = (
        "import torch, harness.sim\n"
        "print(torch.sim.get_memory_size(1), torch.sim.get_device_properties('sim:1').total_memory)\n"
        "try:\n"
        "    torch.empty(2 << 20, dtype=torch.uint8, device='sim:1')\n"
        "except torch.OutOfMemoryError as e:\n"
        "    print('oom', 'sim:1 out of memory' in str(e))\n"
    )
    r = _python(code, env={"PORTHARNESS_SIM_MEMORY_MB": "1.5"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(3 << 19), str(3 << 19), "oom", "True"]
    bad = _python("import harness.sim", env={"PORTHARNESS_SIM_MEMORY_MB": "lots"})
    assert bad.returncode != 0 and "PORTHARNESS_SIM_MEMORY_MB='lots'" in bad.stderr


def test_accelerator_calls_libraries_make_work():
    torch.accelerator.synchronize()
    torch.accelerator.synchronize(1)
    torch.accelerator.empty_cache()
    torch.sim.synchronize("sim:1")
    torch.sim.empty_cache()
    props = torch.sim.get_device_properties("sim:1")
    assert props.total_memory == torch.sim.get_memory_size(1) and "sim" in props.name
    assert torch.sim.is_bf16_supported() and torch.sim.get_device_capability(1) == (props.major, props.minor)


# --- streams and events ---------------------------------------------------------------------------


def test_streams_and_events():
    default = torch.sim.current_stream(1)
    assert default == torch.sim.default_stream(1) and default.stream_id == 0
    s = torch.sim.Stream("sim:1")
    assert s.device == torch.device("sim", 1) and s != default
    with torch.sim.stream(s):
        assert torch.sim.current_stream(1) == s
        assert torch.sim.current_stream(0).stream_id == 0  # per device
        x = torch.ones(3, device="sim:1") * 2
    assert torch.sim.current_stream(1) == default
    with s:
        assert torch.accelerator.current_stream(1) == s  # torch's own calls see the same state
    generic = torch.Stream(device="sim:1")
    generic.wait_stream(s)
    s.synchronize()
    assert s.query() and generic.query()
    start, end = torch.sim.Event(enable_timing=True), torch.sim.Event(enable_timing=True)
    start.record()
    y = x.sum()
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    assert s.record_event().query()
    assert y.item() == 6.0


# --- storages, data pointers, serialization -------------------------------------------------------


def test_storages_and_data_pointers_behave_like_a_device():
    a = torch.arange(6.0, device="sim")
    v = a.view(2, 3)[1]
    b = torch.arange(6.0, device="sim")
    sa, sv = a.untyped_storage(), v.untyped_storage()
    assert sa.device == torch.device("sim", 0) and sa.nbytes() == 24
    assert sa.data_ptr() == sv.data_ptr() and sa is sv  # one storage for all views
    assert b.untyped_storage().data_ptr() != sa.data_ptr()
    assert v.data_ptr() == a.data_ptr() + 3 * 4
    assert sa.cpu().tolist() == list(torch.arange(6.0).untyped_storage().tolist())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated (torch.save still uses it)
        assert a.storage().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with sim.op_profile("young"):  # set_ to a sim storage: how torch rebuilds device tensors
        t = torch.empty(0, device="sim").set_(sa, 3, (3,), (1,))
    assert t.tolist() == [3.0, 4.0, 5.0] and t.data_ptr() == v.data_ptr()


def test_torch_save_and_load_like_a_cuda_tensor(tmp_path):
    w = torch.arange(6.0, device="sim:1").view(2, 3)
    state = {"w": w, "row": w[1], "p": torch.nn.Parameter(torch.ones(2, device="sim"))}
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    back = torch.load(path)  # weights_only: a sim tensor pickles like any device tensor
    assert back["w"].device == torch.device("sim", 1) and back["w"].tolist() == w.tolist()
    assert back["row"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()  # still views
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].device.type == "sim"
    on_cpu = torch.load(path, map_location="cpu")
    assert on_cpu["w"].device.type == "cpu" and torch.equal(on_cpu["w"], w.cpu())
    buf = io.BytesIO()
    torch.save({"x": torch.arange(4.0)}, buf)
    buf.seek(0)
    mapped = torch.load(buf, map_location="sim:1")["x"]
    assert mapped.device == torch.device("sim", 1) and mapped.tolist() == [0.0, 1.0, 2.0, 3.0]


# --- the native library ---------------------------------------------------------------------------


@pytest.mark.long
def test_native_library_is_built_once_into_the_extensions_cache(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = "import torch, harness.sim.native as n\nprint(n.library_path())\n"
    # Two processes start at once on an empty cache: one builds, the other waits for it.
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    path = outs[0][0].strip()
    assert path == outs[1][0].strip() and path.startswith(str(tmp_path / "portharness_sim"))
    built = os.stat(path).st_mtime_ns
    again = _python(code, env=env)
    assert again.returncode == 0 and os.stat(path).st_mtime_ns == built  # loaded, not rebuilt
    assert sorted(os.listdir(os.path.dirname(path))) == ["build.lock", os.path.basename(path)]


def test_a_missing_compiler_is_reported_clearly(tmp_path):
    r = _python("import harness.sim", env={"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "no-such-c++"})
    assert r.returncode != 0
    assert "needs a C++ compiler" in r.stderr and "no-such-c++" in r.stderr
    assert native.library_path().exists()  # this process's own build is unaffected
