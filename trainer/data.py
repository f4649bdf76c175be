"""Training data: conversations in jsonl -> chat template -> token ids + assistant loss mask -> packed rows.

Pipeline (each stage a plain function, tested on its own):

1. `read_conversations(paths)`: ShareGPT (`conversations: [{from, value}]`) or OpenAI (`messages: [{role,
   content}]`) records -> `Conversation`s with normalised roles. Bad records are skipped and counted in a
   `SkipReport` with `file:line`.
2. regeneration (trainer.regenerate, a stage of its own, on trainer.engines): every assistant turn replaced by
   the target's own greedy output (docs/dflash.md §2.1: the drafter must learn what THIS target says).
3. `tokenize(conversations, tokenizer, max_len)`: the tokenizer's chat template; loss mask = 1 on the tokens
   of assistant turns (their content and end-of-turn marker), 0 on system/user text and template glue.
   A run's samples are tokenised into a token store (trainer.store: flat memory-mapped arrays, built once
   per content key by worker processes) that every rank maps; a store indexes to the same `Sample`s.
4. packing the samples into steps: trainer.packing (`plan_epoch`, `build_step`, `target_features`).

Anchors are NOT chosen here: the objective re-draws them every step.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from trainer.atomic import write_lines

# Normalised roles -> the spellings accepted in each format.
_ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}


class DataError(ValueError):
    """The data as a whole is unusable (missing file, nothing left after filtering); says how to fix."""


class BadRecord(ValueError):
    """One record is unusable; `reason` is a short category used for counting."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class SkipReport:
    """Counts of skipped records by reason, with the first few locations of each.

    Attributes:
        counts: reason -> number of records skipped for it.
        where: reason -> up to `max_examples` strings "file:line: detail".
    """

    counts: Counter = field(default_factory=Counter)
    where: dict[str, list[str]] = field(default_factory=dict)
    max_examples: int = 5

    def add(self, source: str, err: BadRecord) -> None:
        self.counts[err.reason] += 1
        lst = self.where.setdefault(err.reason, [])
        if len(lst) < self.max_examples:
            lst.append(f"{source}: {err.detail}" if err.detail else source)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """Human lines: one per reason, with its first locations."""
        if not self.total:
            return "no records skipped"
        lines = [f"skipped {self.total} record(s):"]
        for reason, n in self.counts.most_common():
            lines.append(f"  {n} x {reason}, e.g. " + "; ".join(self.where.get(reason, [])))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "counts": dict(self.counts), "where": self.where}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SkipReport":
        """Inverse of `to_dict`."""
        return cls(Counter(d.get("counts", {})), {k: list(v) for k, v in d.get("where", {}).items()})

    def merge(self, other: "SkipReport") -> None:
        """Add `other`'s counts and locations after this one's (reports of consecutive chunks, merged in
        order, equal the report of one pass over all of them)."""
        for reason, n in other.counts.items():
            self.counts[reason] += n
            lst = self.where.setdefault(reason, [])
            lst.extend(other.where.get(reason, [])[: max(0, self.max_examples - len(lst))])


@dataclass
class Conversation:
    """Normalised messages [{role: system|user|assistant, content: str}] and where they came from."""

    messages: list[dict[str, str]]
    source: str


@dataclass
class Sample:
    """One tokenised conversation.

    Attributes:
        input_ids: token ids of the whole templated conversation.
        loss_mask: 1 where the token belongs to an assistant turn, else 0 (same length).
        source: "file:line" of the record.
    """

    input_ids: list[int]
    loss_mask: list[int]
    source: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


# -- 1. parsing ------------------------------------------------------------------------------------
def _content_text(content: Any) -> str:
    # OpenAI content may be a list of parts; only text parts are meaningful to a text drafter.
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise BadRecord("non-text content", f"content part {str(part)[:40]!r} is not a text part")
        return "".join(texts)
    raise BadRecord("bad message", f"content is {type(content).__name__}, expected a string")


def normalize_record(obj: Any) -> list[dict[str, str]]:
    """One parsed JSON record -> normalised messages.

    Accepts `{"conversations": [{"from": .., "value": ..}]}` (ShareGPT) or `{"messages": [{"role": ..,
    "content": ..}]}` (OpenAI); in either list, either key spelling per message.

    Raises:
        BadRecord: not an object, no message list, a message without role/content, an unknown role,
            or no assistant turn with text.
    """
    if not isinstance(obj, dict):
        raise BadRecord("not an object", f"record is a JSON {type(obj).__name__}")
    msgs = obj.get("conversations", obj.get("messages"))
    if msgs is None:
        raise BadRecord("no messages", "record has neither `conversations` nor `messages`")
    if not isinstance(msgs, list) or not msgs:
        raise BadRecord("no messages", "`conversations`/`messages` is not a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRecord("bad message", f"message {i} is not an object")
        role = m.get("role", m.get("from"))
        if not isinstance(role, str):
            raise BadRecord("bad message", f"message {i} has no `role`/`from`")
        norm = _ROLE_ALIASES.get(role.strip().lower())
        if norm is None:
            raise BadRecord("unknown role", f"message {i} has role {role!r} (known: {', '.join(sorted(_ROLE_ALIASES))})")
        content = m.get("content", m.get("value"))
        if content is None:
            raise BadRecord("bad message", f"message {i} has no `content`/`value`")
        out.append({"role": norm, "content": _content_text(content)})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise BadRecord("no assistant turn", "no assistant message with text")
    return out


def read_conversations(paths: Iterable[str | Path], report: SkipReport | None = None) -> list[Conversation]:
    """Read jsonl files of conversations; skip (and count) bad lines.

    Args:
        paths: jsonl files, one record per line; blank lines are ignored.
        report: where skipped records are counted (a fresh one if None; pass one to see it).

    Returns:
        The usable conversations, in file order.

    Raises:
        DataError: a file does not exist.
    """
    report = report if report is not None else SkipReport()
    out = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{p}: no such data file (check data.train_files / data.eval_files in the config)")
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                conv = parse_line(line, f"{p}:{lineno}", report)
                if conv is not None:
                    out.append(conv)
    return out


def parse_line(line: str, source: str, report: SkipReport) -> Conversation | None:
    """One jsonl line -> its Conversation; None for a blank line or a bad record (counted in `report`)."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        report.add(source, BadRecord("bad JSON", str(exc)))
        return None
    try:
        return Conversation(normalize_record(obj), source)
    except BadRecord as err:
        report.add(source, err)
        return None


# -- 2. regeneration: trainer.engines (the engines) and trainer.regenerate (the stage) ----------------


# -- 3. tokenisation -------------------------------------------------------------------------------
def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
) -> tuple[list[int], list[int]]:
    """Template one conversation; mark the tokens of assistant turns.

    How the assistant spans are found without template-specific markup: for assistant message i, the
    text rendered for messages[:i] + the generation prompt and the text rendered for messages[:i+1] share
    a prefix; what follows it in the latter is that turn (content + end-of-turn). The whole conversation
    must start with each such partial rendering (templates that rewrite history are refused). Tokens are
    then assigned to spans by their character offsets.

    Returns:
        (input_ids, loss_mask).

    Raises:
        BadRecord: the template is not prefix-stable for this conversation, or the tokenizer has no offsets.
    """
    kw = dict(chat_template_kwargs or {})
    full = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False, **kw) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, **kw)
        if not full.startswith(upto):
            raise BadRecord("template not prefix-stable", f"rendering of turn {i} is not a prefix of the whole")
        spans.append((_common_prefix_len(before, upto), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = enc.get("offset_mapping")
    if offsets is None:
        raise BadRecord("tokenizer has no offsets", "use a fast tokenizer (PreTrainedTokenizerFast)")
    # A token belongs to a turn if its first character does; zero-width tokens use their position.
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    inside = np.zeros(len(starts), dtype=bool)
    for s, e in spans:
        inside |= (starts >= s) & (starts < e)
    return ids, inside.astype(np.int64).tolist()


def tokenize(
    conversations: Sequence[Conversation],
    tokenizer: Any,
    max_len: int,
    report: SkipReport | None = None,
    *,
    min_supervised: int = 2,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[Sample]:
    """Tokenise conversations; skip (and count) over-long or nearly unsupervised ones.

    Args:
        max_len: longer samples are skipped (never truncated: a cut response teaches a wrong ending).
        min_supervised: fewer assistant tokens than this leaves no anchor with a label; skipped.

    Returns:
        The samples, in input order.
    """
    report = report if report is not None else SkipReport()
    out = []
    for c in conversations:
        try:
            ids, mask = tokenize_conversation(tokenizer, c.messages, chat_template_kwargs)
            if len(ids) > max_len:
                raise BadRecord("over-long", f"{len(ids)} tokens > data.max_len {max_len}")
            if sum(mask) < min_supervised:
                raise BadRecord("too few assistant tokens", f"{sum(mask)} < {min_supervised}")
        except BadRecord as err:
            report.add(c.source, err)
            continue
        out.append(Sample(ids, mask, c.source))
    return out


def save_samples(samples: Sequence[Sample], path: str | Path) -> None:
    """Write tokenised samples as jsonl (temp file + rename: never half-written).

    The list path, kept as the baseline of bench/data_scale.py and the tests: a run's samples live in a
    token store (trainer.store), whose memory does not grow with the dataset."""
    write_lines(path, (json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask, "source": s.source}) + "\n"
                       for s in samples))


def load_samples(path: str | Path) -> list[Sample]:
    """Inverse of `save_samples`."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(Sample(d["input_ids"], d["loss_mask"], d.get("source", "")))
    return out


def read_prompts(files: Sequence[str], tokenizer: Any, chat_template_kwargs: dict | None, report: SkipReport,
                 missing_hint: str) -> list[list[int]]:
    """Held-out prompts: each jsonl record's messages up to (not including) its first assistant turn, through
    the tokenizer's chat template with the generation prompt (the deployment's template).

    A record without an assistant turn is a prompt as it is. Unreadable records are skipped and counted in
    `report` with file:line. A missing file raises DataError whose message ends with `missing_hint` (where the
    caller's user named the file).
    """
    kw, prompts = dict(chat_template_kwargs or {}), []
    for path in files:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{p}: no such prompt file ({missing_hint})")
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                msgs = obj.get("messages", obj.get("conversations")) if isinstance(obj, dict) else None
                if isinstance(msgs, list) and not any(
                    isinstance(m, dict) and m.get("role", m.get("from")) in ("assistant", "gpt") for m in msgs
                ):
                    obj = {"messages": msgs + [{"role": "assistant", "content": "-"}]}  # validates as a turn
                messages = normalize_record(obj)
            except (json.JSONDecodeError, BadRecord) as exc:
                report.add(f"{p}:{lineno}", exc if isinstance(exc, BadRecord) else BadRecord("bad JSON", str(exc)))
                continue
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            text = tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True, tokenize=False, **kw)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts
