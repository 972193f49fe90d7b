"""Chat templates: prompts for instruct checkpoints, formatted exactly as ``transformers`` does.

A checkpoint folder's tokenizer carries its chat template in ``tokenizer_config.json``
(``chat_template``) or in ``chat_template.jinja`` (which wins when both exist); both are read
by :func:`dlm_toolkit.models.tokenizer.find_tokenizer`. :func:`chat_ids` gives the ids that
``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` gives: the template is
rendered by transformers' own renderer and the text is encoded *without* the tokenizer's special
tokens (the template writes every control token itself; encoding with them would add a second
BOS on tokenizers that add one).

A checkpoint's template is untrusted code: it is rendered in a child process
(:class:`BoundedRenderer`, started once per process, killed and restarted after a refusal) with a
time bound (:data:`RENDER_TIMEOUT_S`), a memory bound (:data:`RENDER_MEMORY_MB` above the
child's own size) and an output bound (:data:`MAX_RENDER_BYTES`). A template over any of them --
two nested ``range(100000)`` loops, a gigabyte of output -- is one :class:`ConfigError` naming
its file (``chat_template.jinja`` or ``tokenizer_config.json``); the CLI exits 2. The child runs
transformers' own renderer with the arguments ``apply_chat_template`` passes, so the ids are
transformers' ids.

Whether a prompt goes through the template is a three-way choice (:data:`CHAT_MODES`):
``auto`` (the default) uses it when the tokenizer has one and encodes raw text otherwise (the
shipped testbeds have none, so their prompts are unchanged), ``true`` requires one, ``false``
never uses it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal, Sequence

from dlm_toolkit.config import ConfigError

__all__ = ["CHAT_MODES", "ChatMode", "chat_ids", "chat_text", "encode_prompt", "has_chat_template", "messages_for",
           "parse_chat_mode", "use_chat"]

ChatMode = Literal["auto", "true", "false"]
CHAT_MODES: tuple[str, ...] = ("auto", "true", "false")


def parse_chat_mode(value: Any, where: str = "chat") -> ChatMode:
    """``auto``/``true``/``false`` from a string or a bool (YAML reads ``chat: true`` as a bool)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in CHAT_MODES:
        return value.lower()  # type: ignore[return-value]
    raise ConfigError(f"{where}: must be one of auto, true, false (got {value!r})")


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (from ``tokenizer_config.json`` or
    ``chat_template.jinja``)."""
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(tokenizer: Any, mode: ChatMode | str | bool, where: str = "chat") -> bool:
    """Resolve a chat mode against a tokenizer: ``auto`` follows the tokenizer.

    Raises:
        ConfigError: ``true`` asked of a tokenizer without a chat template.
    """
    mode = parse_chat_mode(mode, where)
    if mode == "false":
        return False
    present = tokenizer is not None and has_chat_template(tokenizer)
    if mode == "true" and not present:
        raise ConfigError(f"{where}: true, but the checkpoint's tokenizer has no chat template (neither "
                          "'chat_template' in tokenizer_config.json nor chat_template.jinja); use chat: auto or false")
    return present


def messages_for(user: str, system: str | None = None) -> list[dict[str, str]]:
    """``[{"role": "system", ...}, {"role": "user", ...}]``, the system turn only when given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


RENDER_TIMEOUT_S = 10.0  # a real template renders in milliseconds
RENDER_MEMORY_MB = 1024  # above the renderer's size after its imports
MAX_RENDER_BYTES = 16 << 20  # a prompt of 16 MiB is far past any context length
_START_TIMEOUT_S = 120.0  # importing transformers' renderer on a loaded machine

# The child: transformers' renderer behind a pipe. Requests are JSON lines; each reply is one
# header line (OK <bytes> | BIG <bytes> | TIME | MEMORY | ERR <json text>), OK followed by the text.
_CHILD = r"""
import json, resource, signal, sys
sys.path[:] = json.loads(sys.argv[1])
try:  # die with the parent, even mid-render
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)
except Exception:
    pass
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template
with open("/proc/self/statm") as f:
    size = int(f.read().split()[0]) * resource.getpagesize()
limit = size + int(sys.argv[2]) * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
class Late(BaseException):
    pass
def late(*_):
    raise Late()
signal.signal(signal.SIGALRM, late)
out = sys.stdout.buffer
out.write(b"READY\n"); out.flush()
for line in sys.stdin.buffer:
    req = json.loads(line)
    body = b""
    try:
        signal.setitimer(signal.ITIMER_REAL, req["timeout"])
        try:
            rendered, _ = render_jinja_template(conversations=[_normalize_chat_messages(req["messages"])],
                                                tools=None, documents=None, chat_template=req["template"],
                                                return_assistant_tokens_mask=False, continue_final_message=False,
                                                add_generation_prompt=True, **req["kwargs"])
            body = rendered[0].encode("utf-8", "surrogatepass")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        head = b"OK %d" % len(body) if len(body) <= req["max_bytes"] else b"BIG %d" % len(body)
    except Late:
        head = b"TIME"
    except MemoryError:
        head, body = b"MEMORY", b""
    except BaseException as e:
        head = b"ERR " + json.dumps(f"{type(e).__name__}: {e}"[:500]).encode()
    out.write(head + b"\n" + (body if head.startswith(b"OK") else b"")); out.flush()
    body = None
"""


class BoundedRenderer:
    """Renders chat templates in a child process, one request at a time (thread-safe).

    The child starts on the first request; a request over a bound kills it (the next request
    starts a fresh one), so a template can never stall or grow the process that decodes.
    """

    def __init__(self, timeout_s: float = RENDER_TIMEOUT_S, memory_mb: int = RENDER_MEMORY_MB,
                 max_bytes: int = MAX_RENDER_BYTES) -> None:
        self.timeout_s, self.memory_mb, self.max_bytes = timeout_s, memory_mb, max_bytes
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.Lock()
        self._owner = os.getpid()

    def render(self, template: str, messages: Sequence[dict[str, Any]], kwargs: dict[str, Any], where: str) -> str:
        """``template`` rendered as ``apply_chat_template(messages, add_generation_prompt=True,
        tokenize=False)`` renders it, ``kwargs`` being the tokenizer's special tokens.

        Raises:
            ConfigError: ``WHERE: chat template ...`` over a bound or failing to render.
        """
        request = json.dumps({"template": template, "messages": list(messages), "kwargs": kwargs,
                              "timeout": self.timeout_s, "max_bytes": self.max_bytes}).encode() + b"\n"
        with self._lock:
            proc = self._start(where)
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                # the child's own alarm answers first; this deadline covers a C call it cannot interrupt
                head = self._line(proc, time.monotonic() + self.timeout_s + 5.0, where)
                kind, _, rest = head.partition(" ")
                if kind == "OK":
                    body = self._exact(proc, int(rest), time.monotonic() + self.timeout_s + 5.0, where)
                    return body.decode("utf-8", "surrogatepass")
            except (BrokenPipeError, OSError, ValueError):
                self.close()
                raise ConfigError(f"{where}: chat template: the renderer process ended while rendering "
                                  f"(more than {self.memory_mb} MiB?)") from None
            self.close()  # whatever the template did to the child, the next render starts clean
            if kind == "BIG":
                raise ConfigError(f"{where}: chat template renders {rest} bytes, more than the "
                                  f"{self.max_bytes} a prompt may have")
            if kind == "TIME":
                raise ConfigError(f"{where}: chat template did not finish rendering within {self.timeout_s:g} s "
                                  "(a loop without end?)")
            if kind == "MEMORY":
                raise ConfigError(f"{where}: chat template needs more than {self.memory_mb} MiB of memory to render")
            reason = str(json.loads(rest)) if rest else kind
            raise ConfigError(f"{where}: chat template: cannot render ({' '.join(reason.split())})")

    def _start(self, where: str) -> subprocess.Popen:
        if self._owner != os.getpid():  # a forked process never shares its parent's renderer pipes
            self._proc, self._buffer, self._owner = None, b"", os.getpid()
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        path = [p for p in sys.path if p and os.path.abspath(p) != os.getcwd()]
        self._buffer = b""
        self._proc = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, json.dumps(path), str(self.memory_mb)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      close_fds=True)
        try:
            if self._line(self._proc, time.monotonic() + _START_TIMEOUT_S, where) != "READY":
                raise OSError
        except (OSError, ConfigError):
            self.close()
            raise ConfigError(f"{where}: chat template: the renderer process did not start "
                              "(is transformers installed?)") from None
        return self._proc

    def _fill(self, proc: subprocess.Popen, deadline: float, where: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            self.close()
            raise ConfigError(f"{where}: chat template did not finish rendering within {self.timeout_s:g} s "
                              "(a loop without end?)")
        chunk = os.read(proc.stdout.fileno(), 1 << 20)
        if not chunk:
            raise OSError("renderer ended")
        self._buffer += chunk

    def _line(self, proc: subprocess.Popen, deadline: float, where: str) -> str:
        while b"\n" not in self._buffer:
            if len(self._buffer) > 4096:
                raise OSError("renderer protocol")
            self._fill(proc, deadline, where)
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("ascii", "replace")

    def _exact(self, proc: subprocess.Popen, n: int, deadline: float, where: str) -> bytes:
        if not 0 <= n <= self.max_bytes:
            raise OSError("renderer protocol")
        parts, have = [self._buffer[:n]], len(self._buffer[:n])
        self._buffer = self._buffer[n:]
        while have < n:
            self._fill(proc, deadline, where)
            take = self._buffer[:n - have]
            self._buffer = self._buffer[len(take):]
            parts.append(take)
            have += len(take)
        return b"".join(parts)

    def close(self) -> None:
        """Stop the child (a later render starts a new one)."""
        proc, self._proc, self._buffer = self._proc, None, b""
        if proc is None or self._owner != os.getpid():  # a forked copy leaves its parent's renderer alone
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass


_RENDERER = BoundedRenderer()
atexit.register(_RENDERER.close)


def template_file(tokenizer: Any) -> str:
    """The file a tokenizer's chat template came from (``chat_template.jinja`` wins over
    ``tokenizer_config.json``, as in transformers), for messages."""
    folder = getattr(tokenizer, "name_or_path", "") or ""
    if folder and Path(folder).is_dir():
        jinja = Path(folder) / "chat_template.jinja"
        return str(jinja if jinja.is_file() else Path(folder) / "tokenizer_config.json")
    return "the tokenizer's chat template"


def chat_text(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """The template rendered for ``messages`` with the generation prompt (the assistant turn's
    opening) appended: the text the model is conditioned on. Rendered by the bounded child
    process (see the module docstring).

    Raises:
        ConfigError: no template, or one that fails, or exceeds a bound (naming its file).
    """
    if not has_chat_template(tokenizer):
        raise ConfigError("chat: the tokenizer has no chat template")
    where = template_file(tokenizer)
    try:
        template = tokenizer.get_chat_template()
    except ValueError as e:  # a dict of named templates without a default
        raise ConfigError(f"{where}: chat template: {e}") from None
    return _RENDERER.render(template, messages, dict(tokenizer.special_tokens_map), where)


def chat_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of :func:`chat_text`, encoded as ``apply_chat_template(..., tokenize=True)`` does:
    no special tokens added by the tokenizer (the template writes its own)."""
    return list(tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, text: str, chat: bool, system: str | None = None,
                  messages: Sequence[dict[str, str]] | None = None) -> list[int]:
    """A prompt's ids: through the chat template when ``chat`` (``messages`` if given, else one
    user turn holding ``text`` after the optional ``system`` turn), else ``text`` encoded raw."""
    if not chat:
        return list(tokenizer.encode(text, add_special_tokens=False))
    if messages is None:
        messages = messages_for(text, system)
    elif system is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return chat_ids(tokenizer, messages)
