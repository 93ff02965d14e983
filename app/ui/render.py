"""Chat text to Qt rich text (HTML subset), and the model's <think> sections (no Qt).

A small Markdown subset is enough for chat answers: fenced code blocks, inline code, bold,
italics, headings, lists, quotes and links. Everything is escaped first, so model output can
never inject markup.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Colors:
    text: str
    muted: str
    code_bg: str
    code_text: str
    accent: str
    error: str
    user_bg: str


LIGHT = Colors("#1d1d1f", "#6e6e73", "#f2f2f5", "#1d1d1f", "#0a64d8", "#c4281c", "#eef4fd")
DARK = Colors("#e8e8ea", "#9a9aa0", "#1f2125", "#e8e8ea", "#5aa2ff", "#ff6b5e", "#23293a")


# -- thinking ---------------------------------------------------------------------------------
def split_thinking(text: str) -> tuple[str, str, bool]:
    """(thinking, answer, still_open). A lone </think> means the template opened the section
    in the prompt (Qwen3 does), so everything before it is thinking."""
    i = text.find(THINK_OPEN)
    if i >= 0:
        rest = text[i + len(THINK_OPEN) :]
        j = rest.find(THINK_CLOSE)
        if j < 0:
            return rest, text[:i], True
        return rest[:j], text[:i] + rest[j + len(THINK_CLOSE) :], False
    j = text.find(THINK_CLOSE)
    if j >= 0:
        return text[:j], text[j + len(THINK_CLOSE) :], False
    return "", text, False


def strip_thinking(text: str) -> str:
    """The answer alone (what goes back into the prompt and to the clipboard)."""
    return split_thinking(text)[1].strip()


class ThinkSplitter:
    """Splits a token stream into ("think" | "answer", text) pieces as it arrives; a tag cut
    across tokens is held back until it is complete."""

    def __init__(self):
        self.thinking = False
        self.held = ""

    def feed(self, chunk: str) -> list[tuple[str, str]]:
        s = self.held + chunk
        self.held = ""
        out: list[tuple[str, str]] = []
        while s:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            i = s.find(tag)
            if i >= 0:
                if i:
                    out.append(("think" if self.thinking else "answer", s[:i]))
                self.thinking = not self.thinking
                s = s[i + len(tag) :]
                continue
            keep = _partial_suffix(s, tag)
            if len(s) > keep:
                out.append(("think" if self.thinking else "answer", s[: len(s) - keep]))
            self.held = s[len(s) - keep :]
            break
        return out

    def flush(self) -> list[tuple[str, str]]:
        s, self.held = self.held, ""
        return [("think" if self.thinking else "answer", s)] if s else []


def _partial_suffix(s: str, tag: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:n]):
            return n
    return 0


# -- markdown ---------------------------------------------------------------------------------
_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+#.-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*+]\s+(.*)$")
_ORDERED = re.compile(r"^\s*(\d+)[.)]\s+(.*)$")
_LINK = re.compile(r"\[([^\]]+)\]\((https?://[^)\s]+)\)")
_BOLD = re.compile(r"\*\*(.+?)\*\*|__(.+?)__")
_ITALIC = re.compile(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?!\w)|(?<![\w_])_(?!\s)(.+?)(?<!\s)_(?!\w)")


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def inline(text: str, c: Colors) -> str:
    """Escape, then inline code (left untouched inside), bold, italics, links."""
    out = []
    pos = 0
    for m in _CODE_SPAN.finditer(text):
        out.append(_inline_plain(text[pos : m.start()], c))
        out.append(
            f'<code style="background-color:{c.code_bg}; color:{c.code_text}; '
            f'font-family:monospace;">&nbsp;{html.escape(m.group(2).strip())}&nbsp;</code>'
        )
        pos = m.end()
    out.append(_inline_plain(text[pos:], c))
    return "".join(out)


def _inline_plain(text: str, c: Colors) -> str:
    seg = html.escape(text)
    seg = _LINK.sub(
        lambda m: f'<a href="{m.group(2)}" style="color:{c.accent};">{m.group(1)}</a>', seg
    )
    seg = _BOLD.sub(lambda m: f"<b>{m.group(1) or m.group(2)}</b>", seg)
    return _ITALIC.sub(lambda m: f"<i>{m.group(1) or m.group(2)}</i>", seg)


def code_block(code: str, lang: str, c: Colors, copy_href: str = "") -> str:
    copy = (
        (
            f'&nbsp;&nbsp;<a href="{copy_href}" style="color:{c.muted}; text-decoration:none;">'
            "copy code</a>"
        )
        if copy_href
        else ""
    )
    label = (
        f'<tr><td style="color:{c.muted}; font-size:small;">{html.escape(lang)}{copy}</td></tr>'
        if lang or copy
        else ""
    )
    return (
        f'<table width="100%" cellspacing="0" cellpadding="8" style="background-color:{c.code_bg}; '
        f'margin-top:4px; margin-bottom:4px;">{label}<tr><td>'
        f'<pre style="font-family:monospace; color:{c.code_text}; margin-top:0px; margin-bottom:0px;">'
        f"{html.escape(code)}</pre>"
        "</td></tr></table>"
    )


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of `text`, in order, as markdown_to_html finds them (what the
    "copy code" links copy)."""
    lines = text.replace("\r\n", "\n").split("\n")
    out, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        i += 1
        if fence:
            body = []
            while i < len(lines) and not lines[i].strip().startswith(fence.group(1)):
                body.append(lines[i])
                i += 1
            out.append("\n".join(body))
            i += 1
    return out


def markdown_to_html(text: str, c: Colors = LIGHT, code_href=None) -> str:
    """`code_href(n)`: the link of the n-th code block's copy button (None: no button)."""
    lines = text.replace("\r\n", "\n").split("\n")
    n_code = 0
    out: list[str] = []
    para: list[str] = []
    items: list[str] = []
    list_tag = ""

    def flush_para():
        if para:
            out.append("<p>" + "<br>".join(inline(p, c) for p in para) + "</p>")
            para.clear()

    def flush_list():
        nonlocal list_tag
        if items:
            out.append(
                f"<{list_tag}>"
                + "".join(f"<li>{inline(i, c)}</li>" for i in items)
                + f"</{list_tag}>"
            )
            items.clear()
        list_tag = ""

    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            flush_para()
            flush_list()
            marker, lang = fence.group(1), fence.group(2)
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append(lines[i])
                i += 1
            out.append(code_block("\n".join(body), lang, c, code_href(n_code) if code_href else ""))
            n_code += 1
            i += 1  # the closing fence (or past the end: an unterminated block while streaming)
            continue
        if not line.strip():
            flush_para()
            flush_list()
        elif m := _HEADING.match(line):
            flush_para()
            flush_list()
            size = {1: "x-large", 2: "large", 3: "medium"}.get(len(m.group(1)), "medium")
            out.append(f'<p style="font-size:{size};"><b>{inline(m.group(2), c)}</b></p>')
        elif (m := _BULLET.match(line)) or (m := _ORDERED.match(line)):
            flush_para()
            tag = "ul" if m.re is _BULLET else "ol"
            if list_tag and tag != list_tag:
                flush_list()
            list_tag = tag
            items.append(m.group(m.lastindex))
        elif line.startswith(">"):
            flush_para()
            flush_list()
            out.append(
                f'<p style="color:{c.muted}; margin-left:12px;">{inline(line[1:].strip(), c)}</p>'
            )
        else:
            if items:
                flush_list()
            para.append(line)
        i += 1
    flush_para()
    flush_list()
    return "".join(out)


# -- messages ---------------------------------------------------------------------------------
def _words(text: str) -> int:
    return len(text.split())


def message_html(
    mid: int,
    role: str,
    content: str,
    state: str,
    who: str,
    c: Colors,
    expanded: bool = False,
    meta: dict | None = None,
) -> str:
    """One message: a header (who, copy link) and its body; thinking collapsed unless
    `expanded` (the header link toggles it)."""
    meta = meta or {}
    links = (
        f'&nbsp;&nbsp;<a href="copy:{mid}" style="color:{c.muted}; text-decoration:none;">copy</a>'
    )
    head = f'<p style="margin-top:14px; margin-bottom:2px;"><b>{html.escape(who)}</b>{links}</p>'
    thinking, answer, still_open = (
        split_thinking(content) if role == "assistant" else ("", content, False)
    )
    body = ""
    if thinking.strip() or still_open:
        arrow = "▾" if expanded else "▸"
        label = "Thinking…" if still_open else f"Thought for {_words(thinking)} words"
        body += (
            f'<p style="margin:2px;"><a href="think:{mid}" style="color:{c.muted}; '
            f'text-decoration:none;">{arrow} {label}</a></p>'
        )
        if expanded:
            body += f'<div style="color:{c.muted}; margin-left:14px;"><i>{markdown_to_html(thinking.strip(), c)}</i></div>'
    if role == "assistant":
        body += markdown_to_html(answer.strip(), c, lambda n: f"copycode:{mid}:{n}")
    else:
        body += markdown_to_html(content, c)
    notes = {
        "stopped": ("stopped", c.muted),
        "interrupted": ("interrupted: the engine stopped while answering", c.error),
        "error": (f"error: {meta.get('error', 'the engine reported an error')}", c.error),
        "streaming": ("interrupted: the app closed while answering", c.error),
    }
    if state in notes:
        text, color = notes[state]
        body += f'<p style="color:{color};"><i>[{html.escape(text)}]</i></p>'
    if role == "assistant" and meta.get("decode_tps"):
        body += (
            f'<p style="color:{c.muted}; font-size:small;">{meta.get("generated_tokens", 0)} tokens · '
            f"{meta['decode_tps']:.1f} tok/s</p>"
        )
    return head + body
