"""Model-list parsing, lookup and error messages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.models.model_list import (
    COLUMNS,
    ModelEntry,
    ModelListError,
    UnknownModelError,
    find_entry,
    load_model_list,
    parse_model_list,
    resolve_list,
    write_model_list,
)

HEADER = ",".join(COLUMNS)


def write(tmp_path: Path, text: str, name: str = "l.csv") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_parses_all_columns_and_comments(tmp_path: Path) -> None:
    p = write(tmp_path, "\n".join([
        "# a comment",
        "",
        HEADER,
        "  # indented comment",
        'tiny/bert/masked-lm,tiny,bert,masked-lm,text,"{""seq_len"": 8}",a;b; c,,false,1e-4,0.01,',
        "gpt2,hub,gpt2,causal-lm,text,,,main,TRUE,,,",
        "mine,local,bert,seq-cls,text,,,,,,,ckpt",
    ]))
    tiny, hub, local = load_model_list(str(p))
    assert tiny == ModelEntry(id="tiny/bert/masked-lm", source="tiny", arch="bert", task="masked-lm",
                              modality="text", inputs={"seq_len": 8}, tags=("a", "b", "c"), atol=1e-4, rtol=0.01)
    assert hub.revision == "main" and hub.trust_remote_code is True and hub.atol is None
    assert local.path == str((tmp_path / "ckpt").resolve())


def test_minimal_columns_any_order_and_defaults(tmp_path: Path) -> None:
    p = write(tmp_path, "task,id,source\n,bert-base-uncased,hub\n")
    (e,) = load_model_list(str(p))
    assert (e.id, e.source, e.task, e.inputs, e.tags, e.trust_remote_code) == (
        "bert-base-uncased", "hub", "base", {}, (), False)


def test_bare_name_resolution_prefers_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "id,source,task\nx,hub,base\n", name="tiny-zoo.csv")
    monkeypatch.setenv("PORTHARNESS_MODEL_LISTS", str(tmp_path))
    assert resolve_list("tiny-zoo") == tmp_path / "tiny-zoo.csv"
    assert [e.id for e in load_model_list("tiny-zoo")] == ["x"]
    monkeypatch.delenv("PORTHARNESS_MODEL_LISTS")
    assert resolve_list("tiny-zoo").parent.name == "model_lists"  # the repo's own list


def test_unknown_bare_name_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ModelListError, match="known lists:.*smoke"):
        load_model_list("no-such-list")


@pytest.mark.parametrize("text, match", [
    ("id,source,task,colour\n", r":1: unknown column 'colour'"),
    ("id,source,taks\n", r":1: unknown column 'taks'; did you mean 'task'\?"),
    ("id,arch\n", r":1: missing required column\(s\) source, task"),
    ("id,source,task\na,hub,base\n# c\na,hub,base\n", r":4: duplicate id 'a' \(first on line 2\)"),
    ("id,source,task\na,pypi,base\n", r":2: bad source 'pypi' for 'a', use one of tiny, hub, local"),
    ("id,source,task,trust_remote_code\na,hub,base,maybe\n", r":2: bad trust_remote_code value 'maybe'"),
    ("id,source,task,atol\na,hub,base,tiny\n", r":2: bad atol value 'tiny', write a number"),
    ("id,source,task,rtol\na,hub,base,-1\n", r":2: bad rtol value '-1', it must be a finite number >= 0"),
    ('id,source,task,inputs\na,hub,base,"{seq_len: 3}"\n', r":2: bad JSON in inputs"),
    ('id,source,task,inputs\na,hub,base,"[1, 2]"\n', r":2: inputs must be a JSON object"),
    ("id,source,task\na,hub,base,extra\n", r":2: row has 4 cells but the header \(line 1\) has 3"),
    ('id,source,task\n"a,hub,base\n', r":2: unparseable CSV"),
    ("id,source,task\na,tiny,base\n", r":2: tiny entry 'a' needs an arch"),
    ("id,source,task\na,local,base\n", r":2: local entry 'a' needs a path"),
    ("id,source,task\na,hub,causal_lm\n", r":2: unknown task 'causal_lm'.*causal-lm"),
    ("# only a comment\n", r":1: empty model list"),
])
def test_errors_name_file_and_line(tmp_path: Path, text: str, match: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ModelListError, match=match) as info:
        load_model_list(str(p))
    assert str(info.value).startswith(str(p))


def test_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "bad.csv"
    p.write_bytes(b"id,source,task\n\xff\xfe,hub,base\n")
    with pytest.raises(ModelListError, match="not UTF-8"):
        load_model_list(str(p))


def test_write_round_trips(tmp_path: Path) -> None:
    entries = [
        ModelEntry(id="tiny/x/base", source="tiny", arch="x", task="base", modality="text",
                   inputs={"recipe": "audio-3d", "seq_len": 4}, tags=("moe", "slow"), atol=1e-3),
        ModelEntry(id="org/name", source="hub", task="causal-lm", revision="v1", trust_remote_code=True),
    ]
    p = tmp_path / "out.csv"
    write_model_list(entries, p, "generated\nsecond line")
    assert p.read_text().startswith("# generated\n# second line\n")
    assert load_model_list(str(p)) == entries


def test_entry_survives_asdict_and_json() -> None:
    """Workers receive entries as dicts (dataclasses.asdict, possibly via JSON)."""
    e = ModelEntry(id="a", source="tiny", arch="bert", task="base", inputs={"seq_len": 4}, tags=("x",))
    assert ModelEntry(**dataclasses.asdict(e)) == e
    assert ModelEntry(**json.loads(json.dumps(dataclasses.asdict(e)))) == e
    assert hash(e) == hash(ModelEntry(**dataclasses.asdict(e)))


def test_shipped_lists_parse() -> None:
    for name in ("tiny-zoo", "smoke", "hub-top"):
        entries = load_model_list(name)
        assert entries, name
    tiny_ids = {e.id for e in load_model_list("tiny-zoo")}
    smoke = load_model_list("smoke")
    assert {e.id for e in smoke} <= tiny_ids, "smoke.csv must be a subset of tiny-zoo.csv"
    assert all(e.source == "hub" for e in load_model_list("hub-top"))


# ----------------------------------------------------------------------------------------------
# find_entry
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write(tmp_path, "id,source,arch,task\ntiny/bert/masked-lm,tiny,bert,masked-lm\n"
                    "tiny/bert/base,tiny,bert,base\n", name="zoo.csv")
    monkeypatch.setenv("PORTHARNESS_MODEL_LISTS", str(tmp_path))
    return tmp_path


def test_find_entry_in_lists(lists: Path) -> None:
    e = find_entry("tiny/bert/masked-lm", lists=("zoo",))
    assert (e.source, e.arch, e.task) == ("tiny", "bert", "masked-lm")
    assert find_entry("tiny/bert/masked-lm", lists=("zoo",), task="base").task == "base"


def test_find_entry_skips_missing_lists(lists: Path) -> None:
    assert find_entry("tiny/bert/base", lists=("nope", "zoo")).id == "tiny/bert/base"


def test_find_entry_unknown_tiny_suggests(lists: Path) -> None:
    with pytest.raises(UnknownModelError, match="close matches: tiny/bert/masked-lm"):
        find_entry("tiny/bert/masked_lm", lists=("zoo",))


def test_find_entry_local_dir(lists: Path, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    e = find_entry(str(d), lists=("zoo",))
    assert (e.source, e.arch, e.path, e.task) == ("local", "gpt2", str(d.resolve()), "base")


def test_find_entry_hub_ids(lists: Path) -> None:
    assert find_entry("bert-base-uncased", lists=("zoo",)) == ModelEntry(id="bert-base-uncased", source="hub")
    e = find_entry("Qwen/Qwen2.5-0.5B", lists=("zoo",), task="causal-lm")
    assert (e.source, e.task) == ("hub", "causal-lm")
    with pytest.raises(UnknownModelError, match="not a hub id"):
        find_entry("not a/valid/id", lists=("zoo",))


def test_parse_from_string_labels_errors() -> None:
    assert parse_model_list("id,source,task\nx,hub,base\n")[0].id == "x"
    with pytest.raises(ModelListError, match=r"^inline:2: bad source"):
        parse_model_list("id,source,task\nx,web,base\n", path="inline")
