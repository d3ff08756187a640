"""hpcrl/inference/files.py and the weights-path guard: every way a path or a number in a file can be
bad is an APIError (400) naming the field and the path, hand-checked case by case."""

from __future__ import annotations

import json
import os

import pytest

from hpcrl.inference import files
from hpcrl.inference.guard import check_weights_path
from hpcrl.inference.protocol import APIError


def _bad(fn, *args, fragment: str):
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400 and fragment in e.value.message, e.value.message
    return e.value


def test_resolve_names_each_failure(tmp_path):
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    _bad(files.resolve, str(tmp_path / "a"), "path", fragment="symlink loop")
    _bad(files.resolve, str(tmp_path / ("x" * 300)), "path", fragment="too long")
    _bad(files.resolve, str(tmp_path / "dangling"), "path", fragment="does not exist")
    err = _bad(files.resolve, "/x" * 5000, "lora_path", fragment="chars)")  # shown shortened
    assert err.param == "lora_path" and len(err.message) < 400
    assert files.resolve(str(tmp_path), "path") == tmp_path.resolve()


def test_regular_file_refuses_what_would_block_or_is_not_a_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "ok").write_text("{}")
    _bad(files.regular_file, tmp_path / "fifo", "path", fragment="a FIFO")
    _bad(files.regular_file, tmp_path / "dir", "path", fragment="a directory")
    _bad(files.directory, tmp_path / "ok", "path", fragment="a file, not a directory")
    assert files.read_json_object(tmp_path / "ok", "p") == {}
    (tmp_path / "list").write_text("[1]")
    _bad(files.read_json_object, tmp_path / "list", "p", fragment="not a JSON object")


@pytest.mark.parametrize(
    "cfg,fragment",
    [
        ({"r": float("inf")}, "`r` must be finite"),
        ({"r": float("nan")}, "`r` must be finite"),
        ({"r": -3}, "`r` must be >= 1"),
        ({"r": 10**30}, "<= 65536"),
        ({"r": 2.5}, "must be an integer"),
        ({"r": True}, "must be a number"),
        ({"r": "4"}, "must be a number"),
        ({}, "must be a number, got None"),
        ({"r": 4, "lora_alpha": float("inf")}, "`lora_alpha` must be finite"),
        ({"r": 4, "lora_alpha": -1}, "`lora_alpha` must be > 0"),
        ({"r": 4, "lora_alpha": 0}, "`lora_alpha` must be > 0"),
        ({"r": 4, "lora_alpha": 1e30}, "<= 1e+06"),
        ({"r": 4, "use_rslora": 1}, "`use_rslora` must be true or false"),
    ],
)
def test_adapter_numbers_refused(cfg, fragment):
    # json round trip: what the server reads from a file (1e999 -> inf, NaN)
    cfg = json.loads(json.dumps(cfg))
    _bad(files.adapter_numbers, cfg, "adapter_config.json", fragment=fragment)


def test_adapter_numbers_accepted():
    assert files.adapter_numbers({"r": 8}, "x") == (8, 8.0, False)
    assert files.adapter_numbers({"r": 8.0, "lora_alpha": 16, "use_rslora": True}, "x") == (8, 16.0, True)


def test_guard_containment_never_raises_on_unresolvable_paths(tmp_path):
    os.symlink("loop", tmp_path / "loop")
    for raw in (str(tmp_path / "loop"), str(tmp_path / ("n" * 300)), str(tmp_path / "missing" / "x")):
        check_weights_path(raw, str(tmp_path), allow_any=False)  # inside: the loader decides (400)
    with pytest.raises(APIError) as e:
        check_weights_path("/" + "n" * 300, str(tmp_path), allow_any=False)
    assert e.value.status == 403
