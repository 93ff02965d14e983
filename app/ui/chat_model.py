"""The chat as a model: conversations, the message being streamed, and their persistence.

Views listen to its signals; tests drive it directly. A send is: the user message is written,
an empty assistant message is written in state "streaming", tokens extend it in memory and the
partial text is rewritten every PERSIST_INTERVAL_MS, and Done / Error / the worker's death
write its final state. Nothing the user typed or saw is ever only in memory for long.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QGuiApplication

from ..engine import messages as M
from .history import Conversation, ConversationStore, Message
from .render import code_blocks, strip_thinking
from .session import EngineSession

PERSIST_INTERVAL_MS = 500  # the partial answer is at most this old on disk after a crash
TITLE_CHARS = 48
# GenerationSettings fields the chat exposes (the worker validates them again).
DEFAULT_SETTINGS = {
    "max_tokens": 1024,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "seed": None,
    "kv_mode": "fp16",
}


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


class ChatModel(QObject):
    conversations_changed = Signal()
    conversation_changed = Signal(int)  # the current conversation's id (0: none)
    message_added = Signal(object)  # history.Message
    message_changed = Signal(object)  # a message's final text or state
    message_removed = Signal(int)
    stream_started = Signal(int)  # request id
    token_received = Signal(str)
    stream_finished = Signal(str)  # reason: stop | length | cancelled
    stream_failed = Signal(str)  # why (engine error, worker died)
    busy_changed = Signal(bool)
    settings_changed = Signal()

    def __init__(self, session: EngineSession, store: ConversationStore | None = None, parent=None):
        super().__init__(parent)
        self.session = session
        self.store = store or ConversationStore()
        self.recovered = self.store.recover()
        self.current: Conversation | None = None
        self.messages: list[Message] = []
        self.req: int | None = None
        self.streaming: Message | None = None
        self.partial: list[str] = []
        self.dirty = False
        self.default_settings = dict(DEFAULT_SETTINGS)
        self.default_system_prompt = ""
        self.persist = QTimer(self)
        self.persist.setInterval(PERSIST_INTERVAL_MS)
        self.persist.timeout.connect(self._persist_partial)
        b = session.bridge
        b.token.connect(self._on_token)
        b.done.connect(self._on_done)
        b.error.connect(self._on_error)
        session.crashed.connect(self._on_crashed)
        session.hosts_lost.connect(self._on_crashed)  # an answer in flight ends, kept as it is

    # -- conversations -----------------------------------------------------------------------
    def conversations(self) -> list[Conversation]:
        return self.store.conversations()

    def new_conversation(self) -> Conversation | None:
        if self.busy:
            return None
        c = self.store.create(
            "New chat", self._model_name(), self.default_system_prompt, self.default_settings
        )
        self._open(c)
        self.conversations_changed.emit()
        return c

    def open(self, cid: int) -> None:
        if self.busy or (self.current and self.current.id == cid):
            return
        self._open(self.store.get(cid))

    def _open(self, c: Conversation | None) -> None:
        self.current = c
        self.messages = self.store.messages(c.id) if c else []
        self.conversation_changed.emit(c.id if c else 0)
        self.settings_changed.emit()

    def rename_conversation(self, cid: int, title: str) -> bool:
        title = " ".join(title.split())[:200]
        if not title:
            return False  # an empty name keeps the old one
        c = self.store.update(cid, title=title)
        if self.current and self.current.id == cid:
            self.current = c
        self.conversations_changed.emit()
        return True

    def delete_conversation(self, cid: int) -> None:
        if self.busy and self.current and self.current.id == cid:
            return
        self.store.delete(cid)
        if self.current and self.current.id == cid:
            rest = self.store.conversations()
            self._open(rest[0] if rest else None)
        self.conversations_changed.emit()

    def open_latest(self) -> None:
        rest = self.store.conversations()
        self._open(rest[0] if rest else None)

    # -- settings ----------------------------------------------------------------------------
    def settings(self) -> dict:
        s = dict(DEFAULT_SETTINGS)
        s.update(self.current.settings if self.current else self.default_settings)
        return s

    def system_prompt(self) -> str:
        return self.current.system_prompt if self.current else self.default_system_prompt

    def set_settings(self, settings: dict | None = None, system_prompt: str | None = None) -> None:
        """Change the current conversation's settings; they also become the defaults of new
        conversations."""
        new = self.settings()
        if settings:
            unknown = set(settings) - set(DEFAULT_SETTINGS)
            if unknown:
                raise ValueError(f"unknown chat settings {sorted(unknown)}")
            new.update(settings)
        self.default_settings = new
        if system_prompt is not None:
            self.default_system_prompt = system_prompt
        if self.current:
            changes = {"settings": new}
            if system_prompt is not None:
                changes["system_prompt"] = system_prompt
            self.current = self.store.update(self.current.id, **changes)
        self.settings_changed.emit()

    # -- sending -----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.req is not None

    def can_send(self) -> bool:
        return not self.busy and self.session.can_generate()

    def send(self, text: str) -> bool:
        text = text.strip()
        if not text or not self.can_send():
            return False
        if self.current is None:
            self.new_conversation()
        c = self.current
        if not any(m.role == "user" for m in self.messages):
            self.current = self.store.update(c.id, title=_title(text), model=self._model_name())
            self.conversations_changed.emit()
        m = self.store.add_message(c.id, "user", text)
        self.messages.append(m)
        self.message_added.emit(m)
        return self._generate()

    def regenerate(self) -> bool:
        """Answer the last user message again (the previous answer is replaced)."""
        if not self.can_send() or not self.messages:
            return False
        if self.messages[-1].role == "assistant":
            old = self.messages.pop()
            self.store.delete_message(old.id)
            self.message_removed.emit(old.id)
        if not self.messages or self.messages[-1].role != "user":
            return False
        return self._generate()

    def prompt(self) -> list[dict]:
        """The chat messages sent to the engine: the system prompt, then every user message and
        every answer that has text, without its thinking (as chat templates expect)."""
        out = []
        if self.system_prompt().strip():
            out.append({"role": "system", "content": self.system_prompt().strip()})
        for m in self.messages:
            if m.role == "assistant":
                text = strip_thinking(m.content)
                if text:
                    out.append({"role": "assistant", "content": text})
            elif m.role == "user":
                out.append({"role": "user", "content": m.content})
        return out

    def _generate(self) -> bool:
        prompt = self.prompt()
        settings = {k: v for k, v in self.settings().items() if v is not None}
        a = self.store.add_message(
            self.current.id, "assistant", "", state="streaming", meta={"model": self._model_name()}
        )
        self.messages.append(a)
        self.streaming, self.partial, self.dirty = a, [], False
        self.message_added.emit(a)
        rid = self.session.bridge.generate(prompt, settings)
        if rid is None:  # the worker went away between the check and the send
            self._end("interrupted", {"error": "the engine is not running"})
            self.stream_failed.emit("the engine is not running")
            return False
        self.req = rid
        self.persist.start()
        self.busy_changed.emit(True)
        self.stream_started.emit(rid)
        return True

    def stop(self) -> None:
        if self.busy:
            self.session.bridge.cancel()

    def copy_last(self) -> str:
        """Put the last answer (without its thinking) on the clipboard; returns it."""
        for m in reversed(self.messages):
            if m.role == "assistant" and m.content:
                return self.copy_message(m.id)
        return ""

    def copy_message(self, mid: int) -> str:
        for m in self.messages:
            if m.id == mid:
                text = strip_thinking(m.content) if m.role == "assistant" else m.content
                if m is self.streaming:
                    text = strip_thinking("".join(self.partial))
                QGuiApplication.clipboard().setText(text)
                return text
        return ""

    def copy_code(self, mid: int, n: int) -> str:
        """Put the n-th code block of a message's answer on the clipboard; returns it."""
        for m in self.messages:
            if m.id == mid:
                text = "".join(self.partial) if m is self.streaming else m.content
                blocks = code_blocks(strip_thinking(text) if m.role == "assistant" else text)
                if 0 <= n < len(blocks):
                    QGuiApplication.clipboard().setText(blocks[n])
                    return blocks[n]
        return ""

    def partial_text(self) -> str:
        return "".join(self.partial)

    # -- engine events -----------------------------------------------------------------------
    def _on_token(self, msg: M.Token) -> None:
        if msg.req_id != self.req:
            return
        self.partial.append(msg.text)
        self.dirty = True
        self.token_received.emit(msg.text)

    def _persist_partial(self) -> None:
        if self.streaming is not None and self.dirty:
            self.streaming.content = self.partial_text()
            self.store.update_message(self.streaming.id, content=self.streaming.content)
            self.dirty = False

    def _end(self, state: str, meta: dict, text: str | None = None) -> Message | None:
        m = self.streaming
        self.persist.stop()
        self.req = None
        self.streaming = None
        if m is None:
            return None
        m.content = self.partial_text() if text is None else text
        m.state = state
        m.meta.update(meta)
        self.store.update_message(m.id, content=m.content, state=state, meta=m.meta)
        self.message_changed.emit(m)
        self.busy_changed.emit(False)
        return m

    def _on_done(self, msg: M.Done) -> None:
        if msg.req_id != self.req:
            return
        meta = {
            "reason": msg.reason,
            "prompt_tokens": msg.prompt_tokens,
            "generated_tokens": msg.generated_tokens,
            "prompt_tps": msg.prompt_tps,
            "decode_tps": msg.decode_tps,
            "peak_memory": msg.peak_memory,
            "kv_bytes": msg.kv_bytes,
        }
        self._end("stopped" if msg.reason == "cancelled" else "complete", meta, msg.text or None)
        self.stream_finished.emit(msg.reason)

    def _on_error(self, msg: M.Error) -> None:
        if self.req is None or msg.req_id != self.req:
            return
        self._end("error", {"error": f"{msg.kind}: {msg.message}"})
        self.stream_failed.emit(msg.message)

    def _on_crashed(self, message: str) -> None:
        if self.req is None:
            return
        self._end("interrupted", {"error": message})
        self.stream_failed.emit(message)

    def _model_name(self) -> str:
        info = self.session.info
        return info["name"] if info else ""
