"""SFT data: rows from local files or saved HF datasets -> token ids + per-role loss masks -> packed rows.

    load_rows(data)                  jsonl / parquet file, a directory of them, a saved HF datasets
                                     directory (datasets.load_from_disk), or an HF hub name
    row_to_conversation(row)         prompt/completion (TRL) or messages form; messages win; tools
    tokenize_conversation(...)       incremental chat-template rendering -> input_ids, loss_mask
    pack_rows(lengths, seq_len)      balanced rows of <= seq_len tokens (as few as first-fit decreasing)
    DataCursor                       epoch + offset into a seeded per-epoch permutation (resumable)

    python -m hpcrl.trainer.sft_data make-demo OUT.jsonl --task reverse-text --n 2000 --seed 0

Loss masks come from rendering the conversation one message at a time: the tokens that message k
adds to the rendering of messages[:k] belong to message k and take its role's mask. That needs the
template to be *prefix-stable* (rendering a prefix of a conversation is a token prefix of rendering
all of it); templates that rewrite history (Qwen3's stripping of past <think> blocks) are rejected
with a clear error instead of silently training on the wrong tokens.

Everything heavy (datasets, pyarrow, transformers) is imported inside the functions that need it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.errors import UserError, user_errors
from hpcrl.fileio import write_text

ROLES = ("system", "user", "assistant", "tool")
# Roles some datasets use for the same purpose as ours (OpenAI's "developer" is a system turn).
ROLE_ALIASES = {"developer": "system", "function": "tool", "ipython": "tool"}
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(UserError, ValueError):
    """A dataset the user pointed at that cannot be used as given (one line naming the file or field)."""


# ---------------------------------------------------------------------------------------------
# loading rows
# ---------------------------------------------------------------------------------------------
class Rows(Sequence):
    """A dataset as a random-access sequence of dicts, optionally restricted to some indices."""

    def __init__(
        self,
        base: Any,
        indices: Sequence[int] | None = None,
        source: str = "",
        subsets: tuple[list[str], np.ndarray] | None = None,
    ):
        self.base = base
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self.source = source
        # A directory of several files: (file names, first base row of each); seed 001's subsets,
        # whose realized mixing ratios SFT logs (progress/<subset>/ratio_{samples,tokens}).
        self.subsets = subsets

    def subset_of(self, i: int) -> int:
        """Which subset row i comes from (-1: the data has no subsets)."""
        if self.subsets is None:
            return -1
        j = i if self.indices is None else int(self.indices[i])
        return int(np.searchsorted(self.subsets[1], j, side="right")) - 1

    def __len__(self) -> int:
        return len(self.base) if self.indices is None else len(self.indices)

    def __getitem__(self, i):  # type: ignore[override]
        j = i if self.indices is None else int(self.indices[i])
        return self.base[j]

    def subset(self, indices: Sequence[int]) -> Rows:
        idx = np.asarray(indices, dtype=np.int64)
        return Rows(self.base, idx if self.indices is None else self.indices[idx], self.source, self.subsets)


def _need_datasets(why: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{why} needs the `datasets` package: pip install datasets") from None
    return datasets


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".json":
        text = path.read_text()
        if text.lstrip().startswith("["):
            rows = json.loads(text)
            if not all(isinstance(r, dict) for r in rows):
                raise DataError(f"{path}: a .json file must hold a list of objects (or one object per line)")
            return rows
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
    return pq.read_table(path).to_pylist()


def _is_saved_hf_dataset(d: Path) -> bool:
    return any((d / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _looks_local(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.endswith(_FILE_SUFFIXES) or name.count("/") != 1


def locate_rows(name: str, field: str = "data.name") -> tuple[str, Path | None]:
    """What `load_rows` will read for `name`, found without reading it (--dry-run checks it too):
    ("file", path), ("saved", dir) for a saved HF dataset, ("dir", dir) of data files, ("missing", path)
    for a local path that does not exist, or ("hub", None) for an `owner/name` on the Hugging Face hub.
    DataError for what no start could read (empty name, a directory without data files, a file
    type it does not read)."""
    if not name:
        raise DataError(
            f"{field}: empty; give a jsonl/parquet file, a directory of them, or a saved HF dataset"
        )
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix not in _FILE_SUFFIXES:
            raise DataError(
                f"{field}: '{name}' has an unsupported file type '{path.suffix}' (use .jsonl, .json or .parquet)"
            )
        return "file", path
    if path.is_dir():
        if _is_saved_hf_dataset(path):
            return "saved", path
        if not _data_files(path):
            raise DataError(
                f"{field}: directory '{name}' has no .jsonl/.json/.parquet files and is not a "
                f"saved HF dataset (datasets.save_to_disk)"
            )
        return "dir", path
    return ("missing", path) if _looks_local(name) else ("hub", None)


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _FILE_SUFFIXES)


def hub_dataset_cached(name: str, field: str = "data.name") -> bool:
    """Whether hub dataset `name` is in the HF datasets cache: what `datasets.load_dataset` falls back to
    offline (its CachedDatasetModuleFactory), looked up without the network."""
    import logging

    datasets = _need_datasets(f"{field} = '{name}' (a Hugging Face hub dataset)")
    from datasets.load import CachedDatasetModuleFactory

    quiet = logging.getLogger("datasets")  # "Using the latest cached version ..." is for a real load
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        CachedDatasetModuleFactory(name, cache_dir=str(datasets.config.HF_DATASETS_CACHE)).get_module()
    except Exception:  # noqa: BLE001 - FileNotFoundError, or a cache it cannot read: not usable
        return False
    finally:
        quiet.setLevel(level)
    return True


def load_rows(name: str, split: str = "train", field: str = "data.name") -> Rows:
    """All rows of a dataset. Local files are read whole (SFT sets fit in memory); a saved HF
    dataset stays memory-mapped. A name that is not a local path and looks like `owner/name` is
    fetched from the Hugging Face hub with `datasets.load_dataset` (never in tests)."""
    kind, path = locate_rows(name, field)
    if kind == "file":
        return Rows(_read_file(path), source=str(path))
    if kind == "saved":
        return Rows(_load_from_disk(path, split, field), source=str(path))
    if kind == "dir":
        files = _data_files(path)
        rows: list[dict[str, Any]] = []
        starts = []
        for f in files:
            starts.append(len(rows))
            rows += _read_file(f)
        names = [f.relative_to(path).with_suffix("").as_posix() for f in files]
        return Rows(rows, source=str(path), subsets=(names, np.asarray(starts)) if len(files) > 1 else None)
    if kind == "missing":
        raise DataError(
            f"{field}: '{name}' does not exist (expected a jsonl/parquet file, a directory of them, "
            f"or a saved HF datasets directory)"
        )
    datasets = _need_datasets(f"{field} = '{name}' (a Hugging Face hub dataset)")
    return Rows(datasets.load_dataset(name, split=split), source=name)


def _read_file(path: Path) -> list[dict[str, Any]]:
    """A data file of a suffix `locate_rows` accepted."""
    return _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)


def _load_from_disk(path: Path, split: str, field: str) -> Any:
    datasets = _need_datasets(f"{field} = '{path}' (a saved HF dataset)")
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(
                f"{field}: saved dataset '{path}' has splits {sorted(ds)}, not '{split}' (set data.split)"
            )
        ds = ds[split]
    return ds


def holdout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) row indices: a seeded random `fraction` of the rows (at least one) is held out."""
    if fraction <= 0 or n == 0:
        return np.arange(n), np.arange(0)
    k = max(1, int(round(n * fraction)))
    if k >= n:
        raise DataError(f"val.fraction = {fraction} would hold out all {n} rows")
    perm = np.random.default_rng([seed, 0x5A17]).permutation(n)
    return np.sort(perm[k:]), np.sort(perm[:k])


# ---------------------------------------------------------------------------------------------
# rows -> conversations
# ---------------------------------------------------------------------------------------------
@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    # Messages before this index are the prompt of a prompt/completion row: never trained.
    num_prompt_messages: int = 0


def _as_messages(value: Any, default_role: str, what: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, Sequence) and all(isinstance(m, Mapping) for m in value):
        return [_clean_message(m, f"{what}[{i}]") for i, m in enumerate(value)]
    raise DataError(f"{what} must be a string or a list of chat messages, got {type(value).__name__}")


def _clean_message(m: Mapping[str, Any], what: str) -> dict[str, Any]:
    # Columnar formats (parquet, HF datasets) give every message every key, absent ones as None.
    out = {k: v for k, v in m.items() if v is not None}
    role = out.get("role")
    if not isinstance(role, str):
        raise DataError(f"{what} has no 'role'")
    if ROLE_ALIASES.get(role, role) not in ROLES:
        raise DataError(f"{what}: role '{role}' is not one of {', '.join(ROLES)}")
    out.setdefault("content", "")
    return out


def parse_tools(value: Any, what: str = "tools") -> list[dict[str, Any]] | None:
    """A tools column value: a list of OpenAI function specs, or a JSON string of one. verifiers'
    flat `tool_defs` ({name, description, parameters}) are wrapped into the OpenAI shape."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{what}: not valid JSON ({e.msg})") from None
    if not isinstance(value, Sequence) or not all(isinstance(t, Mapping) for t in value):
        raise DataError(f"{what}: expected a list of tool definitions (OpenAI function format)")
    out = []
    for t in value:
        t = {k: v for k, v in t.items() if v is not None}
        if "function" not in t and "name" in t:
            t = {"type": "function", "function": t}
        out.append(t)
    return out or None


def row_to_conversation(
    row: Mapping[str, Any], where: str = "row", template_defaults: Mapping[str, Any] | None = None
) -> Conversation:
    """`template_defaults` (the config's enable_thinking / reasoning_effort) apply to every render of
    the conversation; a row's own chat_template_kwargs override them key by key."""
    tools = parse_tools(row.get("tools"), f"{where}.tools")
    if tools is None:
        tools = parse_tools(row.get("tool_defs"), f"{where}.tool_defs")
    kwargs = row.get("chat_template_kwargs")
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs) if kwargs.strip() else None
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise DataError(f"{where}.chat_template_kwargs must be an object")
    kwargs = {
        **(template_defaults or {}),
        **{k: v for k, v in (kwargs or {}).items() if v is not None},
    } or None
    if row.get("messages") is not None:
        msgs = _as_messages(row["messages"], "user", f"{where}.messages")
        return Conversation(msgs, tools, kwargs, 0)
    if row.get("prompt") is not None and row.get("completion") is not None:
        prompt = _as_messages(row["prompt"], "user", f"{where}.prompt")
        completion = _as_messages(row["completion"], "assistant", f"{where}.completion")
        return Conversation(prompt + completion, tools, kwargs, len(prompt))
    raise DataError(
        f"{where}: needs a 'messages' column or 'prompt' and 'completion' columns (found {sorted(row)})"
    )


# ---------------------------------------------------------------------------------------------
# conversations -> tokens + loss mask
# ---------------------------------------------------------------------------------------------
@dataclass
class TokenizedSample:
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # bool [L], aligned with input_ids: True = token t is trained
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


class TemplateError(ValueError):
    """The chat template is not prefix-stable, so per-message loss masks cannot be built."""


def render_ids(
    tokenizer: Any, messages: list[dict[str, Any]], conv: Conversation, gen_prompt: bool
) -> list[int]:
    if not messages and not gen_prompt:
        return []
    text = tokenizer.apply_chat_template(
        messages,
        tools=conv.tools,
        tokenize=False,
        add_generation_prompt=gen_prompt,
        **(conv.template_kwargs or {}),
    )
    # Same as apply_chat_template(tokenize=True), whose return type differs across transformers versions.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(
    tokenizer: Any, conv: Conversation, role_mask: Mapping[str, bool], where: str = "row"
) -> TokenizedSample:
    """Render messages[:k] for k = 1..n; the tokens message k adds take role_mask[its role].

    For an assistant message, the generation prompt the template puts before it (e.g.
    `<|im_start|>assistant\\n`) is not trained: at inference the server writes it, the model does
    not - the same tokens RL trains on."""
    ids: list[int] = []
    mask: list[bool] = []
    for k, msg in enumerate(conv.messages):
        role = ROLE_ALIASES.get(msg["role"], msg["role"])
        train = bool(role_mask.get(role, False)) and k >= conv.num_prompt_messages
        header = 0
        if role == "assistant" and train and k > 0:
            gen = render_ids(tokenizer, conv.messages[:k], conv, gen_prompt=True)
            header = len(gen) - len(ids) if gen[: len(ids)] == ids else 0
        full = render_ids(tokenizer, conv.messages[: k + 1], conv, gen_prompt=False)
        if full[: len(ids)] != ids:
            raise TemplateError(
                f"{where}: the chat template is not prefix-stable: rendering messages[:{k}] is not a "
                f"token prefix of rendering messages[:{k + 1}] (role '{msg['role']}'), so per-role loss "
                f"masks would be wrong. Use a template that does not rewrite earlier turns (e.g. one that "
                f"keeps past <think> blocks)"
            )
        if header and full[: len(ids) + header] != gen:
            header = 0  # the generation prompt is not how this template starts the turn: train it all
        new = len(full) - len(ids)
        mask += [False] * min(header, new) + [train] * max(new - header, 0)
        ids = full
    if mask:
        mask[0] = False  # nothing predicts a sample's first token
    return TokenizedSample(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))


def truncate(sample: TokenizedSample, seq_len: int) -> TokenizedSample:
    if len(sample) <= seq_len:
        return sample
    return TokenizedSample(sample.input_ids[:seq_len], sample.loss_mask[:seq_len], truncated=True)


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------
def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row, every row <= seq_len tokens (a longer sample gets a row of its own).

    First-fit decreasing finds how many rows are needed; the samples are then spread over that many
    rows longest-first into the emptiest row (the orchestrator's rank balancing), which leaves the
    rows about equally full instead of FFD's full rows plus one short tail, so padding the rows to
    a common length (static-shape kernels, a [rows, T] batch) wastes little. Falls back to the FFD
    rows when balancing would overflow one. Deterministic; each row lists its samples ascending."""
    from hpcrl.balance import assign_to_ranks

    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(max(seq_len - n, 0))
    if not rows:
        return []
    balanced = [r for r in assign_to_ranks(lengths, len(rows)) if r]
    if all(len(r) == 1 or sum(int(lengths[i]) for i in r) <= seq_len for r in balanced):
        return balanced
    return [sorted(r) for r in rows]


def padding_waste(lengths: Sequence[int], rows: Sequence[Sequence[int]], row_len: int | None = None) -> float:
    """Fraction of a [num_rows, row_len] batch that would be padding (row_len None: the longest row)."""
    fill = [sum(int(lengths[i]) for i in r) for r in rows]
    total = len(rows) * (max(fill, default=0) if row_len is None else row_len)
    return 1.0 - sum(fill) / total if total else 0.0


# ---------------------------------------------------------------------------------------------
# epochs
# ---------------------------------------------------------------------------------------------
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The row order of one epoch: a pure function of (seed, epoch), so a resume needs only the cursor."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass
class DataCursor:
    """Position in the stream of epochs: the next row is epoch_order(...)[offset] of `epoch`."""

    num_rows: int
    seed: int
    shuffle: bool
    epoch: int = 0
    offset: int = 0

    def take(self, k: int) -> np.ndarray:
        """The next k row indices (crossing into the next epoch when this one runs out)."""
        if self.num_rows == 0:
            raise DataError("data: the dataset has no rows")
        out = []
        while k > 0:
            order = epoch_order(self.num_rows, self.seed, self.epoch, self.shuffle)
            part = order[self.offset : self.offset + k]
            out.append(part)
            k -= len(part)
            self.offset += len(part)
            if self.offset >= self.num_rows:
                self.epoch, self.offset = self.epoch + 1, 0
        return np.concatenate(out) if out else np.arange(0)

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.offset / max(self.num_rows, 1)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_rows": self.num_rows, "seed": self.seed}

    def restore(self, state: Mapping[str, Any]) -> None:
        if int(state["num_rows"]) != self.num_rows or int(state["seed"]) != self.seed:
            raise DataError(
                f"data: the checkpoint was taken on {state['num_rows']} rows with seed {state['seed']}; "
                f"this run has {self.num_rows} rows with seed {self.seed} (same data needed to resume)"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


# ---------------------------------------------------------------------------------------------
# demo data
# ---------------------------------------------------------------------------------------------
def make_demo(
    out: str | os.PathLike[str], task: str = "reverse-text", n: int = 2000, seed: int = 0
) -> tuple[Path, int]:
    """Messages-form rows for a built-in single-turn environment: its prompt plus the known answer."""
    from hpcrl.envs.registry import load_environment

    env = load_environment(task, num_examples=n, seed=seed)
    if getattr(env, "max_turns", 1) != 1:
        raise DataError(
            f"make-demo: '{task}' is multi-turn; only single-turn environments have a one-message answer"
        )
    tasks = env.tasks("train")
    lines = []
    for t in list(tasks)[:n]:
        if not t.answer:
            raise DataError(f"make-demo: '{task}' task {t.example_id} has no known answer")
        msgs = [dict(m) for m in t.prompt] + [{"role": "assistant", "content": t.answer}]
        lines.append(json.dumps({"messages": msgs}, ensure_ascii=False))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "\n".join(lines) + "\n")
    return path, len(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcrl.trainer.sft_data")
    sub = p.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("make-demo", help="write a messages-form jsonl from a built-in environment")
    demo.add_argument("out")
    demo.add_argument("--task", default="reverse-text")
    demo.add_argument("--n", type=int, default=2000)
    demo.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def make() -> int:
        path, count = make_demo(args.out, args.task, args.n, args.seed)
        print(f"wrote {count} rows to {path}")
        return 0

    return user_errors(make)


if __name__ == "__main__":
    sys.exit(main())
