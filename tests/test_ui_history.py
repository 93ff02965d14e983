"""Conversation storage and chat rendering, without a window: the SQLite history, Markdown to
rich text, and the <think> splitter fed token by token."""

from __future__ import annotations

import random
import sqlite3

import pytest

from app.ui import render
from app.ui.history import FORMAT_VERSION, ConversationStore, HistoryError


def test_store_round_trip_and_order(tmp_path):
    s = ConversationStore(tmp_path / "h.sqlite3")
    a = s.create("first", "M", "Be brief.", {"temperature": 0.5})
    b = s.create("second")
    s.add_message(a.id, "user", "hi")
    m = s.add_message(a.id, "assistant", "", state="streaming", meta={"model": "M"})
    s.update_message(m.id, content="hel")
    s.update_message(
        m.id, content="hello", state="complete", meta={"model": "M", "decode_tps": 9.5}
    )
    got = s.messages(a.id)
    assert [(x.role, x.content, x.state) for x in got] == [
        ("user", "hi", "complete"),
        ("assistant", "hello", "complete"),
    ]
    assert got[1].meta == {"model": "M", "decode_tps": 9.5}
    assert [c.id for c in s.conversations()] == [a.id, b.id]  # most recently updated first
    c = s.update(b.id, title="renamed", settings={"seed": 1})
    assert (c.title, c.settings, c.system_prompt) == ("renamed", {"seed": 1}, "")
    assert s.get(a.id).system_prompt == "Be brief." and s.get(a.id).settings == {"temperature": 0.5}
    s.delete(a.id)
    assert s.messages(a.id) == []  # messages go with their conversation
    with pytest.raises(HistoryError, match="no conversation"):
        s.get(a.id)
    with pytest.raises(ValueError, match="bad message role"):
        s.add_message(b.id, "robot", "x")
    with pytest.raises(ValueError, match="cannot change"):
        s.update(b.id, created=0)


def test_partial_answers_survive_a_crash_and_are_marked(tmp_path):
    path = tmp_path / "h.sqlite3"
    s = ConversationStore(path)
    c = s.create()
    s.add_message(c.id, "user", "tell me")
    m = s.add_message(c.id, "assistant", "", state="streaming")
    s.update_message(m.id, content="Once upon a")
    # no close: the process dies. Another process opens the file.
    s2 = ConversationStore(path)
    assert [(x.content, x.state) for x in s2.messages(c.id)][-1] == ("Once upon a", "streaming")
    assert s2.recover() == 1
    assert s2.messages(c.id)[-1].state == "interrupted"
    assert s2.recover() == 0


def test_newer_format_is_refused_with_the_file_name(tmp_path):
    path = tmp_path / "h.sqlite3"
    ConversationStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {FORMAT_VERSION + 1}")
    db.close()
    with pytest.raises(HistoryError, match=r"h\.sqlite3.*newer than this app"):
        ConversationStore(path)


def _filled(path):
    s = ConversationStore(path)
    for i in range(40):
        c = s.create(f"chat {i}")
        s.add_message(c.id, "user", "x" * 2000)
    s.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s.close()
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["garbage", "bad header", "truncated", "directory"])
def test_damaged_history_is_set_aside_and_the_app_starts_empty(tmp_path, damage):
    path = tmp_path / "h.sqlite3"
    data = _filled(path)
    if damage == "garbage":
        path.write_bytes(bytes(random.Random(1).randrange(256) for _ in range(50_000)))
    elif damage == "bad header":
        path.write_bytes(b"SQLite format 2\0" + data[16:])
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 3])
    else:
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("kept")
    kept = path.read_bytes() if path.is_file() else None
    s = ConversationStore(path)
    assert s.set_aside is not None and s.set_aside.name.startswith("h.sqlite3.damaged-")
    if kept is not None:
        assert s.set_aside.read_bytes() == kept  # nothing of the user's is deleted
    else:
        assert (s.set_aside / "inside").read_text() == "kept"
    assert s.conversations() == []
    c = s.create("new")
    s.add_message(c.id, "user", "hello")
    s.close()
    again = ConversationStore(path)
    assert again.set_aside is None and [x.title for x in again.conversations()] == ["new"]


def test_history_files_are_private(tmp_path, monkeypatch):
    import os
    import stat

    from app import paths

    monkeypatch.setenv("ROTARYQUANT_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "data").mkdir(parents=True, mode=0o755)
    s = ConversationStore()
    s.create("x")
    assert stat.S_IMODE(os.stat(paths.data_dir()).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(paths.log_dir()).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    s.close()


def test_split_thinking_cases():
    assert render.split_thinking("<think>a b</think>answer") == ("a b", "answer", False)
    assert render.split_thinking("pre<think>still going") == ("still going", "pre", True)
    assert render.split_thinking("opened in the prompt</think>answer") == (
        "opened in the prompt",
        "answer",
        False,
    )
    assert render.split_thinking("plain") == ("", "plain", False)
    assert render.strip_thinking("<think>x</think>\n\nDone.") == "Done."


@pytest.mark.parametrize("seed", range(5))
def test_think_splitter_matches_whole_text_split_at_any_cut(seed):
    rng = random.Random(seed)
    text = "Intro <think>step one < two </thi nk> more</think> The answer <b>is</b> 4. <think"
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    sp = render.ThinkSplitter()
    out = []
    for p in pieces:
        out += sp.feed(p)
    out += sp.flush()
    think = "".join(t for k, t in out if k == "think")
    answer = "".join(t for k, t in out if k == "answer")
    assert think == "step one < two </thi nk> more"
    assert answer == "Intro  The answer <b>is</b> 4. <think"


def test_markdown_subset_and_escaping():
    c = render.LIGHT
    h = render.markdown_to_html(
        "# Title\n\nSome **bold**, *it*, `a<b>` and [link](https://x.org).\n\n"
        "- one\n- two\n\n1. first\n\n```python\nif a < b:\n    print('<script>')\n```\n> quoted <i>",
        c,
    )
    assert "<b>Title</b>" in h and "<b>bold</b>" in h and "<i>it</i>" in h
    assert "a&lt;b&gt;" in h and "monospace" in h
    assert '<a href="https://x.org"' in h
    assert "<ul><li>one</li><li>two</li></ul>" in h and "<ol><li>first</li></ol>" in h
    assert "if a &lt; b:\n    print(&#x27;&lt;script&gt;&#x27;)" in h and ">python<" in h
    assert "<script>" not in h and "<i>" not in h.split("quoted")[1]
    # an unterminated fence (mid-stream) is still code to the end
    assert "monospace" in render.markdown_to_html("```\ncode", c)


def test_message_html_states():
    c = render.DARK
    h = render.message_html(7, "assistant", "<think>hmm</think>Hi", "interrupted", "M", c)
    assert 'href="think:7"' in h and "Thought for 1 words" in h and "hmm" not in h
    assert "interrupted" in h and c.error in h
    h = render.message_html(
        7, "assistant", "<think>hmm</think>Hi", "complete", "M", c, expanded=True
    )
    assert "hmm" in h and "interrupted" not in h
    h = render.message_html(
        8, "assistant", "x", "error", "M", c, meta={"error": "EngineError: boom"}
    )
    assert "EngineError: boom" in h
