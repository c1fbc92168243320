"""The `sim` c10d backend and its collective settings: same numbers as plain gloo on CPU, every setting.

Multi-process checks start ranks with ``torch.multiprocessing.spawn`` and meet through a FileStore in
``tmp_path`` (no ports, so pytest-xdist workers never collide). Data are small integers held in
float32, so sums are exact in any order and results must be *equal* to gloo's, not just close; the
hierarchical (per-host) plans add in a different order than gloo's ring, which equality would
otherwise punish for no fault.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

import harness.sim
import harness.sim.distributed as sd
from harness.bench import collectives as hc
from harness.bench import ranks
from harness.cli import main as cli_main
from harness.results.store import ResultStore

# Settings small enough that the test tensors are split into several uneven messages.
SETTINGS_2 = [
    "fused",
    "skinny:1k",
    "cap:1000",
    "bucket:0",
    "bucket:2k",
    "per-host:1",
    "per-host:2",
    "skinny:1k+cap:600+per-host:1",
]
SETTINGS_4 = ["per-host:2", "skinny:1k+cap:600+per-host:2", "per-host:4"]
DDP_SETTINGS = ["fused", "skinny:4k", "bucket:0+cap:2k", "per-host:2"]
TIMEOUT = datetime.timedelta(seconds=180)  # generous: xdist runs several worlds on 2 cores
# No dropout (sim and CPU RNGs differ); token ids inside the tiny vocabulary.
TINY_GPT2 = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}


# ----------------------------------------------------------------------------------------------
# Rank code (runs in spawned processes)
# ----------------------------------------------------------------------------------------------


def _data(gen: torch.Generator, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)


def _check(name: str, spec: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, f"{spec}/{name}: {got.shape} vs {want.shape}"
    assert torch.equal(got, want), f"{spec}/{name}: sim differs from gloo\n{got}\n{want}"


def _collectives(rank: int, world: int, spec: str, ref, dev: str, sizes: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + len(spec))
    sim = lambda t: t.clone().to(dev)  # noqa: E731
    sd.set_collective_settings(sd.parse_setting(spec))
    for n in sizes:
        for dtype in (torch.float32, torch.int64):
            x = _data(gen, n, dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                s, c = sim(x), x.clone()
                dist.all_reduce(s, op=op)
                dist.all_reduce(c, op=op, group=ref)
                _check(f"all_reduce {op} n={n} {dtype}", spec, s, c)
        x = _data(gen, n)
        for root in (0, world - 1):
            s, c = sim(x), x.clone()
            dist.broadcast(s, src=root)
            dist.broadcast(c, src=root, group=ref)
            _check(f"broadcast root={root} n={n}", spec, s, c)

        outs_s = [torch.empty(n).to(dev) for _ in range(world)]
        outs_c = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs_s, sim(x))
        dist.all_gather(outs_c, x, group=ref)
        for r in range(world):
            _check(f"all_gather[{r}] n={n}", spec, outs_s[r], outs_c[r])

        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        big_s, big_c = torch.empty(n * world).to(dev), torch.empty(n * world)
        gather_single(big_s, sim(x))
        gather_single(big_c, x, group=ref)
        _check(f"all_gather_into_tensor n={n}", spec, big_s, big_c)

        ins = [_data(gen, n) for _ in range(world)]
        out_s, out_c = torch.empty(n).to(dev), torch.empty(n)
        dist.reduce_scatter(out_s, [sim(i) for i in ins])
        dist.reduce_scatter(out_c, [i.clone() for i in ins], group=ref)
        _check(f"reduce_scatter n={n}", spec, out_s, out_c)

        scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        flat = torch.cat(ins)
        out_s, out_c = torch.empty(n).to(dev), torch.empty(n)
        scatter_single(out_s, sim(flat))
        scatter_single(out_c, flat.clone(), group=ref)
        _check(f"reduce_scatter_tensor n={n}", spec, out_s, out_c)

        # all_to_all_single, uneven: rank i sends (i + j + 1) * n elements to rank j; skinny/cap split it per peer
        send = [(rank + j + 1) * n for j in range(world)]
        recv = [(i + rank + 1) * n for i in range(world)]
        x = _data(gen, sum(send))
        out_s, out_c = torch.empty(sum(recv)).to(dev), torch.empty(sum(recv))
        dist.all_to_all_single(out_s, sim(x), recv, send)
        dist.all_to_all_single(out_c, x.clone(), recv, send, group=ref)
        _check(f"all_to_all_single n={n}", spec, out_s, out_c)

        # Several tensors in one call: packed by the bucket setting
        ins = [_data(gen, n * world), _data(gen, 3 * world)]
        got = funcol.reduce_scatter_tensor_coalesced([sim(i) for i in ins], "sum", [0, 0], dist.group.WORLD)
        for g, i in zip(got, ins, strict=True):
            want = torch.empty(i.numel() // world)
            scatter_single(want, i.clone(), group=ref)
            _check(f"reduce_scatter_tensor_coalesced n={n}", spec, g, want)

    # Many small tensors: packed by the bucket setting; compared with one gloo all_reduce each.
    tensors = [_data(gen, n) for n in (3, 500, 1000, 17, 256)]
    sims = [sim(t) for t in tensors]
    dist.group.WORLD.allreduce_coalesced(sims).wait()
    for i, t in enumerate(tensors):
        c = t.clone()
        dist.all_reduce(c, group=ref)
        _check(f"allreduce_coalesced[{i}]", spec, sims[i], c)

    # Async: the work's future yields the caller's sim tensors, which DDP's reducer relies on.
    x = _data(gen, 1000)
    s, c = sim(x), x.clone()
    work = dist.all_reduce(s, async_op=True)
    value = work.get_future().wait()
    work.wait()
    dist.all_reduce(c, group=ref)
    assert value[0].device.type == "sim" and value[0] is s, (
        f"{spec}: future value {value}"
    )
    _check("all_reduce async", spec, s, c)
    dist.barrier()


def _ddp(rank: int, spec: str, ref) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    s = sd.parse_setting(spec)
    sd.set_collective_settings(s)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16, **TINY_GPT2)
    torch.manual_seed(0)
    cpu_model = GPT2LMHeadModel(cfg)
    torch.manual_seed(1)  # a different init on purpose: DDP's initial broadcast must make them equal
    sim_model = GPT2LMHeadModel(cfg)
    if rank == 0:
        sim_model.load_state_dict(cpu_model.state_dict())
    dev = ranks.ddp_device("sim", rank)
    sim_model.to(dev)
    assert sim_model.lm_head.weight is sim_model.transformer.wte.weight  # moving keeps the tie
    cpu_ddp = DDP(cpu_model, process_group=ref, bucket_cap_mb=s.bucket_mb)
    sim_ddp = DDP(sim_model, bucket_cap_mb=s.bucket_mb)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):  # the second step uses DDP's rebuilt buckets
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        for model in (cpu_model, sim_model):
            model.zero_grad()
        cpu_ddp(input_ids=ids, labels=ids).loss.backward()
        sim_ddp(input_ids=ids.to(dev), labels=ids.to(dev)).loss.backward()
        for (name, p), q in zip(cpu_model.named_parameters(), sim_model.parameters(), strict=True):
            assert q.grad is not None, f"{spec}: no grad for {name} on sim"
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-6, msg=f"{spec}: grad {name}")


def _worker(rank: int, world: int, workdir: str, specs: list[str], ddp_specs: list[str]) -> None:
    # more ranks than sim devices, which take one process each: each rank is its own simulated host
    os.environ["PORTHARNESS_SIM_NAMESPACE"] = f"{os.environ.get('PORTHARNESS_SIM_NAMESPACE', '')}:r{rank}"
    harness.sim.set_op_profile("full")  # DDP needs ops the young profile lacks (see the benchmark note)
    harness.sim.set_precision("highest")  # compare communication, not the bf16 matmul default
    store = dist.FileStore(os.path.join(workdir, "store"), world)
    dist.init_process_group("sim", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        assert dist.get_backend() == "sim"
        ref = dist.new_group(backend="gloo")
        dev = f"sim:{rank % harness.sim.device_count()}"
        sizes = (1, 1000, 4099) if world == 2 else (1, 1003)  # 4 ranks on 2 cores: keep it short
        for spec in specs:
            _collectives(rank, world, spec, ref, dev, sizes)
        for spec in ddp_specs:
            _ddp(rank, spec, ref)
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, world: int, specs: list[str], ddp_specs: list[str]) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path), specs, ddp_specs), nprocs=world, join=True)


# ----------------------------------------------------------------------------------------------
# Multi-process conformance
# ----------------------------------------------------------------------------------------------


@pytest.mark.long
def test_every_collective_and_setting_matches_gloo_and_ddp_world_2(tmp_path) -> None:
    _spawn(tmp_path, 2, SETTINGS_2, DDP_SETTINGS)


@pytest.mark.long
def test_per_host_with_two_hosts_matches_gloo_world_4(tmp_path) -> None:
    # World 2 cannot have two multi-rank hosts; this is where the inter-host stage really runs.
    _spawn(tmp_path, 4, SETTINGS_4, [])


# ----------------------------------------------------------------------------------------------
# Message plans, in one process (a world of one over a recording transport)
# ----------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for the gloo transport and records each message it is asked to send."""

    def __init__(self, real) -> None:
        self.real = real
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str):
        fn = getattr(self.real, name)

        def call(*args, **kwargs):
            first = args[0]
            while isinstance(first, list):
                first = first[0]
            self.calls.append((name, first.numel()))
            return fn(*args, **kwargs)

        return call


@pytest.fixture()
def world_of_one(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    pg = sd.ShapedProcessGroup(store, 0, 1, TIMEOUT, unwrap=sd._unwrap_sim, name="sim")
    pg._world = _Recorder(pg._world)
    yield pg
    sd.set_collective_settings(sd.CollectiveSettings())


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        ("fused", [1000]),
        ("skinny:1k", [256, 256, 256, 232]),
        ("cap:1600", [400, 400, 200]),
        ("skinny:1k+cap:400", [100] * 10),
    ],
)
def test_settings_split_messages(world_of_one, spec: str, sizes: list[int]) -> None:
    sd.set_collective_settings(sd.parse_setting(spec))
    t = torch.ones(1000).to("sim")
    world_of_one.allreduce([t]).wait()
    assert world_of_one._world.calls == [("allreduce", n) for n in sizes]
    assert torch.equal(t.cpu(), torch.ones(1000))


def test_bucket_setting_packs_coalesced_tensors(world_of_one) -> None:
    tensors = [torch.full((256,), float(i)).to("sim") for i in range(8)]  # 1 KiB each
    for spec, messages in (("fused", [2048]), ("bucket:2k", [512] * 4), ("bucket:0", [256] * 8)):
        world_of_one._world.calls.clear()
        sd.set_collective_settings(sd.parse_setting(spec))
        world_of_one.allreduce_coalesced(tensors).wait()
        assert world_of_one._world.calls == [("allreduce", n) for n in messages], spec
    assert [t.cpu()[0].item() for t in tensors] == [float(i) for i in range(8)]


def test_bucket_setting_packs_coalesced_gathers_and_scatters(world_of_one) -> None:
    ins = [torch.full((256,), float(i)).to("sim") for i in range(4)]  # 1 KiB each
    outs = [torch.empty(256).to("sim") for _ in range(4)]
    planner = world_of_one.planner
    for spec, messages in (("fused", [1024]), ("bucket:2k", [512] * 2), ("bucket:0", [256] * 4)):
        sd.set_collective_settings(sd.parse_setting(spec))
        world_of_one._world.calls.clear()
        planner.allgather_into_tensor_coalesced(outs, ins).wait()
        assert world_of_one._world.calls == [("allgather", n) for n in messages], spec
        world_of_one._world.calls.clear()
        planner.reduce_scatter_tensor_coalesced(outs, ins).wait()
        assert world_of_one._world.calls == [("reduce_scatter", n) for n in messages], spec
    assert [t.cpu()[0].item() for t in outs] == [float(i) for i in range(4)]


def test_sim_group_refuses_cpu_tensors_clearly(world_of_one) -> None:
    with pytest.raises(RuntimeError, match="need sim tensors"):
        world_of_one.allreduce([torch.ones(3)])


def test_non_contiguous_tensor_is_refused(world_of_one) -> None:
    t = harness.sim.tensor.to_sim(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="non-contiguous"):
        world_of_one.allreduce([t])


# ----------------------------------------------------------------------------------------------
# Settings parsing and validation
# ----------------------------------------------------------------------------------------------


def test_parse_setting_presets_and_combinations() -> None:
    base = sd.parse_setting("fused")
    assert base == sd.CollectiveSettings() and base.message_limit() == 0
    s = sd.parse_setting("skinny")
    assert s.skinny and s.message_limit() == sd.DEFAULT_SKINNY_BYTES
    assert sd.parse_setting("bucket:256k").bucket_mb == 0.25
    assert sd.parse_setting("cap:1m").max_message_bytes == 1 << 20
    s = sd.parse_setting("skinny:16k+per-host:4+cap:8k")
    assert (s.skinny_bytes, s.placement, s.ranks_per_host, s.message_limit()) == (16384, "per-host", 4, 8192)
    assert sd.parse_setting("per-host+per-device").placement == "per-device"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("fast", "unknown setting 'fast'"),
        ("", "empty setting"),
        ("cap:lots", "bad size 'lots'"),
        ("bucket", "unknown setting 'bucket'"),
        ("per-host:0", "ranks_per_host must be >= 1"),
        ("skinny:0", "skinny_bytes must be a positive"),
        ("fused+warp", "unknown setting 'warp'"),
    ],
)
def test_parse_setting_errors_name_the_grammar(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        sd.parse_setting(spec)
    assert "joined by '+'" in str(info.value)


def test_parse_size() -> None:
    assert [sd.parse_size(x) for x in ("4096", "4k", "64KiB", "16m", "1g", 12)] == [
        4096,
        4096,
        65536,
        16 << 20,
        1 << 30,
        12,
    ]
    for bad in ("", "k", "-4k", "1.5", "4x", "0.3k"):
        with pytest.raises(ValueError, match="bad size"):
            sd.parse_size(bad)


def test_settings_from_env() -> None:
    env = {
        sd.SKINNY_ENV: "1",
        sd.SKINNY_BYTES_ENV: "8k",
        sd.BUCKET_MB_ENV: "1.5",
        sd.MAX_MESSAGE_ENV: "1m",
        sd.PLACEMENT_ENV: "per-host",
        sd.RANKS_PER_HOST_ENV: "4",
    }
    s = sd.settings_from_env(env)
    assert s == sd.CollectiveSettings(True, 8192, 1.5, 1 << 20, "per-host", 4)
    assert sd.settings_from_env({}) == sd.CollectiveSettings()
    for key, bad in ((sd.SKINNY_ENV, "maybe"), (sd.PLACEMENT_ENV, "per-rack"), (sd.BUCKET_MB_ENV, "big")):
        with pytest.raises(ValueError, match="per-rack|expected"):
            sd.settings_from_env({key: bad})


def test_settings_context_manager_restores() -> None:
    before = sd.get_collective_settings()
    with sd.collective_settings(skinny=True, max_message_bytes=4096):
        assert sd.get_collective_settings().message_limit() == 4096
    assert sd.get_collective_settings() == before


def test_pieces_cover_exactly() -> None:
    assert sd.pieces(10, 4, 0) == [(0, 10)]
    assert sd.pieces(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]
    assert sd.pieces(0, 4, 16) == [(0, 0)]
    assert sd.pieces(3, 8, 4) == [(0, 1), (1, 2), (2, 3)]  # a cap below one element: one per message


def test_backends_registered() -> None:
    for name in ("sim", "shaped_gloo", "shaped_nccl"):
        assert name.upper() in dist.Backend._plugins
    assert dist.Backend.default_device_backend_map["sim"] == "sim"
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # not hijacked


# ----------------------------------------------------------------------------------------------
# Benchmark driver (no processes)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--world-size", "1"], "world size must be an integer >= 2"),
        (["--settings", "fused,turbo"], "unknown setting 'turbo'"),
        (["--sizes", "10"], "bad size 10"),
        (["--sizes=-4096"], "bad size '-4096'"),
        (["--settings", "per-host:3"], "does not divide world size 2"),
        (["--target", "tpu"], "unknown target 'tpu'"),
        (["--repeats", "0"], "repeats must be >= 1"),
        (["--settings", "skinny,skinny"], "duplicate settings"),
    ],
)
def test_collectives_cli_rejects_bad_arguments(capsys, argv: list, match: str) -> None:
    assert cli_main(["collectives", "--no-ddp", *argv]) == 2
    err = capsys.readouterr().err
    assert "portharness collectives: error:" in err and match in err


def test_baseline_always_measured_first() -> None:
    cfg = hc.BenchConfig(settings=["skinny", "cap:1k"]).with_baseline()
    assert cfg.settings == ["fused", "skinny", "cap:1k"]
    assert hc.BenchConfig(settings=["skinny", "fused"]).with_baseline().settings == ["fused", "skinny"]


def _fake_result() -> hc.BenchResult:
    times = {
        ("all_reduce", 4096, "fused"): [1.0, 2.0, 1.0, 1.0],
        ("all_reduce", 4096, "skinny"): [2.0, 2.0, 3.0, 2.0],
        (hc.DDP_OP, 1000, "fused"): [0.5, 0.5, 0.5, 0.5],
        (hc.DDP_OP, 1000, "skinny"): [0.6, 0.7, 0.6, 0.6],
    }
    settings = {n: sd.parse_setting(n).as_dict() for n in ("fused", "skinny")}
    cfg = hc.BenchConfig(settings=["fused", "skinny"], repeats=4)
    note = {"ddp_device": ["sim:0", "sim:0"], "ddp_params": 250, "ddp_grad_bytes": 1000}
    return hc.BenchResult(cfg, hc.summarize(times, settings), note, 1.0)


def test_summarize_pairs_ratios_per_repeat() -> None:
    ms = {(m.op, m.setting): m for m in _fake_result().measurements}
    sk = ms[("all_reduce", "skinny")]
    assert sk.median_s == 2.0
    assert sk.ratio == 2.0  # per-repeat ratios 2, 1, 3, 2
    assert sk.ratio_p10 == pytest.approx(1.3) and sk.ratio_p90 == pytest.approx(2.7)
    base = ms[("all_reduce", "fused")]
    assert (base.ratio, base.ratio_p10, base.ratio_p90) == (1.0, 1.0, 1.0)
    assert ms[(hc.DDP_OP, "skinny")].ratio == pytest.approx(1.2)
    assert hc.spread([1, 2, 3, 4])[1] == 2.5


def test_rows_recorded_and_table(tmp_path) -> None:
    result = _fake_result()
    db = tmp_path / "c.db"
    run_id = hc.record(result, db)
    with ResultStore(db) as store:
        df = store.collectives(run_id)
        runs = store.runs()
    assert len(df) == 4
    row = df[(df.op == "all_reduce") & (df.setting == "skinny")].iloc[0]
    assert (row.backend, row.world_size, row.baseline_setting, row.repeats) == ("sim(gloo)", 2, "fused", 4)
    assert row.ratio == 2.0 and row.settings["skinny"] is True and row.settings["kind"] == "collective"
    assert runs.iloc[0].list_name == "collectives" and runs.iloc[0].settings["kind"] == "collective"
    table = hc.format_table(result)
    assert "all_reduce" in table and "4 KiB" in table and "2.00" in table and "1.30-2.70" in table
    assert "ddp_step" in table and "sim:0, sim:0" in table


def test_benchmark_end_to_end_small(tmp_path, capsys) -> None:
    db = tmp_path / "bench.db"
    argv = ["collectives", "--sizes", "4096", "--repeats", "2", "--warmup", "1", "--settings", "skinny:1k",
            "--db", str(db), "--json", "--no-ddp"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    import json

    payload = json.loads(out[: out.rindex("}") + 1])
    rows = {(r["op"], r["setting"]) for r in payload["rows"]}
    assert rows == {(op, s) for op in hc.OPS for s in ("fused", "skinny:1k")}
    assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in payload["rows"])
    with ResultStore(db) as store:
        assert len(store.collectives(payload["run_id"])) == 2 * len(hc.OPS)
