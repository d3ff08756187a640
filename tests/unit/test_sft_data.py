"""SFT data: loading, chat rendering with per-role loss masks, tools, packing, epochs, demo data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcrl.trainer import sft_data as sd

ASSISTANT_ONLY = {"system": False, "user": False, "assistant": True, "tool": False}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from hpcrl.models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def masked_runs(tok, s: sd.TokenizedSample) -> list[str]:
    """The decoded text of every contiguous run of trained tokens."""
    runs, cur = [], []
    for t, m in zip(s.input_ids.tolist(), s.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# loss masks
# ---------------------------------------------------------------------------------------------
def test_assistant_mask_exact_positions(tok):
    conv = sd.Conversation(
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    )
    s = sd.tokenize_conversation(tok, conv, ASSISTANT_ONLY)
    prompt = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    n_prompt, n_reply = len(ids(tok, prompt)), len(ids(tok, "yo<|im_end|>\n"))
    assert s.input_ids.tolist() == ids(tok, prompt + "yo<|im_end|>\n")
    # Trained: exactly the reply and its end-of-turn tokens, not the assistant header.
    assert np.flatnonzero(s.loss_mask).tolist() == list(range(n_prompt, n_prompt + n_reply))
    assert masked_runs(tok, s) == ["yo<|im_end|>\n"]


def test_masks_by_role_multi_turn_with_tools(tok):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "add 1 2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "three"},
    ]
    conv = sd.Conversation(msgs)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>\n'
    s = sd.tokenize_conversation(tok, conv, ASSISTANT_ONLY)
    assert masked_runs(tok, s) == [call, "three<|im_end|>\n"]
    s = sd.tokenize_conversation(tok, conv, {"system": True, "user": True, "assistant": False, "tool": True})
    # The first token of a sample is never trained (nothing predicts it).
    assert masked_runs(tok, s) == [
        "system\nS<|im_end|>\n<|im_start|>user\nadd 1 2<|im_end|>\n",
        "<|im_start|>tool\n3<|im_end|>\n",
    ]
    s = sd.tokenize_conversation(
        tok, conv, {"system": False, "user": False, "assistant": False, "tool": True}
    )
    assert masked_runs(tok, s) == ["<|im_start|>tool\n3<|im_end|>\n"]


def test_template_that_rewrites_history_is_rejected(tiny_model_dir):
    from hpcrl.models.tokenizer import load_tokenizer

    bad = load_tokenizer(tiny_model_dir)
    # Like Qwen3 dropping past reasoning: only the last message keeps its content.
    bad.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{%- if loop.last %}{{ m['content'] }}{%- endif %}<|im_end|>\n{%- endfor %}"
    )
    conv = sd.Conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    with pytest.raises(sd.TemplateError, match=r"not prefix-stable.*messages\[:1\]"):
        sd.tokenize_conversation(bad, conv, ASSISTANT_ONLY, where="data.jsonl row 7")


# ---------------------------------------------------------------------------------------------
# row formats
# ---------------------------------------------------------------------------------------------
def test_prompt_completion_trains_completion_only(tok):
    conv = sd.row_to_conversation({"prompt": "hi", "completion": "yo"})
    assert conv.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    everything = dict.fromkeys(sd.ROLES, True)
    assert masked_runs(tok, sd.tokenize_conversation(tok, conv, everything)) == ["yo<|im_end|>\n"]
    conv = sd.row_to_conversation(
        {
            "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
            "completion": [{"role": "assistant", "content": "a"}],
        }
    )
    assert conv.num_prompt_messages == 2
    assert masked_runs(tok, sd.tokenize_conversation(tok, conv, everything)) == ["a<|im_end|>\n"]


def test_messages_win_over_prompt_completion():
    row = {
        "prompt": "p",
        "completion": "c",
        "messages": [{"role": "user", "content": "m"}, {"role": "assistant", "content": "n"}],
    }
    conv = sd.row_to_conversation(row)
    assert [m["content"] for m in conv.messages] == ["m", "n"]
    assert conv.num_prompt_messages == 0
    with pytest.raises(ValueError, match="needs a 'messages' column or 'prompt' and 'completion'"):
        sd.row_to_conversation({"text": "x"}, "row 3")
    with pytest.raises(ValueError, match="role 'narrator' is not one of"):
        sd.row_to_conversation({"messages": [{"role": "narrator", "content": "x"}]})


def test_columnar_none_fields_are_dropped():
    conv = sd.row_to_conversation(
        {
            "messages": [
                {"role": "user", "content": "q", "tool_calls": None},
                {"role": "assistant", "content": None},
            ]
        }
    )
    assert conv.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    "column,value",
    [
        ("tools", [TOOL]),
        ("tools", json.dumps([TOOL])),
        ("tool_defs", json.dumps([TOOL["function"]])),  # verifiers' flat shape
    ],
)
def test_tools_column_reaches_the_template(tok, column, value):
    row = {
        "messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny"}],
        column: value,
    }
    conv = sd.row_to_conversation(row)
    assert conv.tools == [TOOL]
    s = sd.tokenize_conversation(tok, conv, ASSISTANT_ONLY)
    text = tok.decode(s.input_ids.tolist(), skip_special_tokens=False)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert masked_runs(tok, s) == ["sunny<|im_end|>\n"]
    with pytest.raises(ValueError, match="tools: not valid JSON"):
        sd.row_to_conversation({**row, "tools": "[{"})


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(6)
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_jsonl_parquet_and_directories(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = write_jsonl(tmp_path / "a.jsonl", ROWS[:4])
    assert [r["messages"][0]["content"] for r in sd.load_rows(str(f))] == ["q0", "q1", "q2", "q3"]
    pq.write_table(pa.Table.from_pylist(ROWS[4:]), tmp_path / "b.parquet")
    rows = sd.load_rows(str(tmp_path))
    assert len(rows) == 6 and rows[5]["messages"][1]["content"] == "a5"
    sub = rows.subset([5, 0])
    assert [r["messages"][0]["content"] for r in sub] == ["q5", "q0"]


def test_load_saved_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    rows = sd.load_rows(str(tmp_path / "ds"))
    assert len(rows) == 6 and sd.row_to_conversation(rows[2]).messages[0]["content"] == "q2"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(tmp_path / "dd"))
    assert len(sd.load_rows(str(tmp_path / "dd"), split="train")) == 2
    with pytest.raises(ValueError, match=r"has splits \['train'\], not 'test'"):
        sd.load_rows(str(tmp_path / "dd"), split="test")


def test_missing_and_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="data.name: '.*nope.jsonl' does not exist"):
        sd.load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        sd.load_rows(str(tmp_path / "bad.jsonl"))


def test_holdout_split_is_seeded_and_disjoint():
    tr, va = sd.holdout_split(100, 0.1, seed=3)
    assert len(va) == 10 and len(tr) == 90 and not set(tr) & set(va)
    assert (sd.holdout_split(100, 0.1, seed=3)[1] == va).all()


# ---------------------------------------------------------------------------------------------
# packing, truncation, epochs
# ---------------------------------------------------------------------------------------------
def test_pack_rows_keeps_samples_whole_and_counts_waste():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 120, size=200).tolist() + [300]  # one over-long sample
    rows = sd.pack_rows(lengths, 256)
    placed = sorted(i for r in rows for i in r)
    assert placed == list(range(len(lengths)))  # every sample exactly once, none split
    for r in rows:
        assert sum(lengths[i] for i in r) <= 256 or len(r) == 1
    waste = sd.padding_waste(lengths, rows, 256)
    assert waste == pytest.approx(1 - sum(lengths) / (256 * len(rows)))
    assert waste < 0.05  # first-fit decreasing on many small samples fills rows well
    assert sd.pack_rows(lengths, 256) == rows  # deterministic


def test_truncate_is_flagged():
    s = sd.TokenizedSample(np.arange(10, dtype=np.int32), np.ones(10, dtype=bool))
    t = sd.truncate(s, 4)
    assert t.truncated and len(t) == 4 and not sd.truncate(s, 10).truncated


def test_micro_batches_respect_rows_and_samples():
    import torch

    from hpcrl.trainer.sft import micro_batches_for

    rng = np.random.default_rng(1)
    samples = []
    for n in rng.integers(5, 60, size=40):
        m = np.ones(n, dtype=bool)
        m[0] = False
        samples.append(sd.TokenizedSample(rng.integers(0, 300, n).astype(np.int32), m))
    mbs, waste = micro_batches_for(samples, seq_len=64, micro_tokens=128, device=torch.device("cpu"))
    assert 0 <= waste < 1
    got = []
    for mb in mbs:
        assert mb.num_tokens <= 128
        mb.validate()
        off = 0
        for n in mb.seq_lens.tolist():
            assert mb.position_ids[off : off + n].tolist() == list(range(n))
            got.append(tuple(mb.input_ids[off : off + n].tolist()))
            off += n
    assert sorted(got) == sorted(tuple(s.input_ids.tolist()) for s in samples)


def test_cursor_crosses_epochs_and_resumes_exactly():
    c = sd.DataCursor(10, seed=1, shuffle=True)
    stream = np.concatenate([c.take(4) for _ in range(5)])  # 20 rows = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert (stream[:10] != stream[10:]).any()  # a new order each epoch
    a = sd.DataCursor(10, seed=1, shuffle=True)
    a.take(4)
    a.take(4)
    b = sd.DataCursor(10, seed=1, shuffle=True)
    b.restore(json.loads(json.dumps(a.state())))  # what a checkpoint stores
    assert np.concatenate([b.take(4) for _ in range(3)]).tolist() == stream[8:20].tolist()
    assert b.epochs_done == 2.0
    with pytest.raises(ValueError, match="same data needed to resume"):
        sd.DataCursor(11, seed=1, shuffle=True).restore(a.state())


def test_sft_batch_shards_ranks_and_counts_truncation(tok, tmp_path):
    import torch

    from hpcrl.config.schema import SFTConfig, SFTDataConfig, SFTValConfig
    from hpcrl.trainer.sft import SFTData

    rows = ROWS + [{"prompt": "x" * 80, "completion": "y"}]  # truncated: its reply is cut off -> dropped
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = SFTConfig(
        data=SFTDataConfig(name=str(f), batch_size=7, shuffle=False), seq_len=32, val=SFTValConfig(interval=0)
    )
    data = SFTData.from_config(cfg)
    data.tokenizer = tok
    b = data.next_batch(0, 1, torch.device("cpu"))
    assert b.totals["truncated"] == 1 and b.totals["dropped"] == 1 and b.totals["samples"] == 6
    assert data.cursor.state()["epoch"] == 1
    # Ranks take the step's rows by stride: together exactly the step's rows.
    idx = sd.DataCursor(7, 0, False).take(7)
    assert sorted(np.concatenate([idx[r::3] for r in range(3)]).tolist()) == idx.tolist()


# ---------------------------------------------------------------------------------------------
# demo data
# ---------------------------------------------------------------------------------------------
def test_make_demo_reverse_text(tmp_path):
    out = tmp_path / "demo" / "train.jsonl"
    assert sd.main(["make-demo", str(out), "--task", "reverse-text", "--n", "50", "--seed", "0"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 50
    for r in rows:
        user = next(m["content"] for m in r["messages"] if m["role"] == "user")
        assert r["messages"][-1] == {"role": "assistant", "content": user[::-1]}
    again = tmp_path / "again.jsonl"
    sd.make_demo(again, "reverse-text", 50, 0)
    assert again.read_text() == out.read_text()  # deterministic in the seed
