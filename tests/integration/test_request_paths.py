"""Generated: every admin route that takes a path x every way a path can fail to be read, and every number
read from an adapter or weights file x {inf, NaN, negative, huge}, against a real hf server.

Each answer is a 4xx naming the field (never a 5xx, never a hang), and the weights and adapter loaded
before (a real LoRA adapter, merged) still serve: /weights is unchanged and a seeded request answers
identically. The routes: /update_weights `path`, /load_lora_adapter and /v1/load_lora_adapter
`lora_path` (hpcrl/inference/api.py; files are read through hpcrl/inference/files.py).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest

NO_READ = "/proc/sys/vm/compact_memory"  # mode 0200: EACCES even for root (tests run as root)
MSGS = [{"role": "user", "content": "hello"}]
REF = {"messages": MSGS, "max_tokens": 6, "seed": 3, "temperature": 1.0, "logprobs": True}
ROUTES: dict[str, tuple[str, tuple[str, ...]]] = {  # route -> (path field, files it reads inside the dir)
    "/update_weights": ("path", ("model.safetensors", "delta.safetensors")),
    "/load_lora_adapter": ("lora_path", ("adapter_config.json", "adapter_model.safetensors")),
    "/v1/load_lora_adapter": ("lora_path", ("adapter_config.json", "adapter_model.safetensors")),
}
KINDS = ("too-long", "loop", "directory", "fifo", "no-permission", "dangling")
BAD_NUMBERS = {"inf": "1e999", "nan": "NaN", "negative": "-3", "huge": "1" + "0" * 30}
MOD = "model.layers.0.self_attn.q_proj"


def _no_read_available() -> bool:
    try:
        with open(NO_READ, "rb"):
            return False  # readable here: the case would not fail
    except PermissionError:
        return True
    except OSError:
        return False


def _body(route: str, path: str) -> dict[str, Any]:
    if route == "/update_weights":
        return {"step": 5, "path": path}
    return {"lora_name": "bad", "lora_path": path, "step": 5}


def _make_bad(target: Path, kind: str) -> str:
    """Make `target` (a path the server will read) fail in the way `kind` says; the path to send."""
    if kind == "too-long":
        return str(target.parent / ("n" * 300))
    if kind == "loop":
        os.symlink(target.name + ".other", target)
        os.symlink(target.name, target.parent / (target.name + ".other"))
    elif kind == "directory":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "no-permission":
        os.symlink(NO_READ, target)
    elif kind == "dangling":
        os.symlink(target.parent / "no-such-target", target)
    return str(target)


def _path_cases() -> list[Any]:
    out = []
    for route, (_, inner) in ROUTES.items():
        for where in ("top", *inner):
            for kind in KINDS:
                if kind == "too-long" and where != "top":
                    continue  # inner names are fixed by the format
                marks = []
                if kind == "no-permission":
                    marks = [pytest.mark.skipif(not _no_read_available(), reason=f"{NO_READ} is readable")]
                out.append(pytest.param(route, where, kind, id=f"{route}:{where}:{kind}", marks=marks))
    return out


def _st_header(shape: str, offsets: str, length: str | None = None) -> bytes:
    """A safetensors file with one F32 tensor, its header's numbers given as raw JSON tokens."""
    header = f'{{"w":{{"dtype":"F32","shape":[{shape}],"data_offsets":[0,{offsets}]}}}}'.encode()
    n = struct.pack("<Q", len(header)) if length is None else struct.pack("<q", int(float(length)))
    return n + header + b"\0" * 8


def _number_cases() -> list[Any]:
    out = []
    for label, tok in BAD_NUMBERS.items():
        for key in ("r", "lora_alpha", "use_rslora"):
            out.append(pytest.param("adapter_config", key, tok, id=f"adapter_config.{key}={label}"))
        for key in ("base_step", "shape"):
            out.append(pytest.param("delta_manifest", key, tok, id=f"delta_manifest.{key}={label}"))
        for key in ("shape", "data_offsets"):
            for f in ("model.safetensors", "adapter_model.safetensors"):
                out.append(pytest.param(f, key, tok, id=f"{f}.{key}={label}"))
        if label in ("negative", "huge"):  # the 8-byte header length (an integer field: no inf/NaN)
            for f in ("model.safetensors", "adapter_model.safetensors"):
                out.append(pytest.param(f, "header_length", tok, id=f"{f}.header_length={label}"))
    return out


PATH_CASES, NUMBER_CASES = _path_cases(), _number_cases()


def _good_adapter(d: Path, model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    w = load_file(str(model_dir / "model.safetensors"))[f"{MOD}.weight"]
    g = torch.Generator().manual_seed(0)
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    save_file(
        {
            f"base_model.model.{MOD}.lora_A.weight": torch.randn(2, w.shape[1], generator=g) * 0.5,
            f"base_model.model.{MOD}.lora_B.weight": torch.randn(w.shape[0], 2, generator=g) * 0.5,
        },
        str(d / "adapter_model.safetensors"),
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from tests.conftest import InferenceServer

    s = InferenceServer(tiny_model_dir, tmp_path_factory.mktemp("paths_run"))
    s.http = httpx.Client(base_url=s.base_url, timeout=10)
    s.cases = tmp_path_factory.mktemp("path_cases")
    good = s.cases / "good_adapter"
    _good_adapter(good, tiny_model_dir)
    s.good = good
    r = s.http.post("/load_lora_adapter", json={"lora_name": "good", "lora_path": str(good), "step": 2})
    assert r.status_code == 200, r.text
    s.weights = s.http.get("/weights").json()
    s.reference = _reference(s)
    yield s
    s.http.close()
    s.stop()


def _reference(s: Any) -> Any:
    r = s.http.post("/v1/chat/completions", json=REF)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["message"]["content"], [x["logprob"] for x in ch["logprobs"]["content"]], ch.get("policy_steps")


def _refused(s: Any, route: str, body: dict[str, Any], field: str) -> str:
    r = s.http.post(route, json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["param"] == field or field in err["message"], err
    return err["message"]


@pytest.mark.parametrize("route,where,kind", PATH_CASES)
def test_path_that_cannot_be_read_is_a_4xx(server, tiny_model_dir, route, where, kind):
    import shutil

    field, _ = ROUTES[route]
    case = server.cases / f"{route.strip('/').replace('/', '_')}-{where}-{kind}"
    case.mkdir()
    if where == "top":
        path = _make_bad(case / "target", kind)
    else:  # a real weights / adapter dir whose one file `where` is bad
        src = server.good if field == "lora_path" else tiny_model_dir
        for f in ROUTES[route][1]:
            if f != where and (src / f).exists():
                shutil.copy(src / f, case / f)
        if where == "delta.safetensors":  # next to complete full weights: no fallback to them
            shutil.copy(tiny_model_dir / "model.safetensors", case / "model.safetensors")
        _make_bad(case / where, kind)
        path = str(case)
    message = _refused(server, route, _body(route, path), field)
    assert "nothing was loaded" in message or "no .safetensors" in message or "cannot read" in message, (
        message
    )
    assert server.http.get("/weights").json() == server.weights


@pytest.mark.parametrize("file,key,token", NUMBER_CASES)
def test_bad_number_in_a_file_is_a_4xx(server, tiny_model_dir, file, key, token):
    import shutil

    from safetensors.torch import load_file, save_file

    case = server.cases / f"num-{file}-{key}-{token[:6]}"
    case.mkdir()
    if file == "adapter_config":
        route, field = "/load_lora_adapter", "lora_path"
        shutil.copy(server.good / "adapter_model.safetensors", case)
        (case / "adapter_config.json").write_text(f'{{"r": 2, "lora_alpha": 4, "{key}": {token}}}')
    elif file == "delta_manifest":
        route, field = "/update_weights", "path"
        name = f"{MOD}.weight"
        w = load_file(str(tiny_model_dir / "model.safetensors"))[name]
        layout = {name: ["float32", list(w.shape), "dense"]}
        manifest = json.dumps({"base_step": 2, "base_checksum": server.weights["checksum"], "layout": layout})
        if key == "base_step":
            manifest = manifest.replace('"base_step": 2', f'"base_step": {token}')
        else:
            manifest = manifest.replace(json.dumps(list(w.shape)), f"[{token}, {w.shape[1]}]")
        save_file({name: w.clone()}, str(case / "delta.safetensors"), metadata={"hpcrl_delta": manifest})
    else:
        route, field = (
            ("/update_weights", "path")
            if file == "model.safetensors"
            else ("/load_lora_adapter", "lora_path")
        )
        if field == "lora_path":
            shutil.copy(server.good / "adapter_config.json", case)
        shape, offsets, length = "2", "8", None
        if key == "shape":
            shape = token
        elif key == "data_offsets":
            offsets = token
        else:
            length = token if token != BAD_NUMBERS["huge"] else str(2**62)
        (case / file).write_bytes(_st_header(shape, offsets, length))
    message = _refused(server, route, _body(route, str(case)), field)
    assert message


def test_loaded_weights_and_adapter_still_serve(server):
    """Run last in this module (pytest keeps file order): nothing refused above replaced anything."""
    assert server.http.get("/weights").json() == server.weights
    assert server.weights["lora_adapters"] == {"good": str(server.good)}
    assert _reference(server) == server.reference
    assert server.http.get("/health").json()["status"] == "ok"


def test_case_counts():
    assert len(PATH_CASES) >= 3 * 6 and len(NUMBER_CASES) >= 4 * 9
