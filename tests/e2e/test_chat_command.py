"""``shardwise chat`` through a terminal (a pty): two turns, the second reusing the first's cache and
answering as a fresh computation of the whole conversation does, /reset, /exit."""

from __future__ import annotations

import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

from shardwise.infer.generate import Sampling, generate, load_for_generation, prompt_ids
from tests.helpers import ROOT, tiny_qwen3

pytestmark = pytest.mark.e2e

STATS = re.compile(r"\[(\d+) prompt tokens run, (\d+) reused from the cache, (\d+) generated")


class Terminal:
    """A command on a pseudo-terminal: what it printed, read until a pattern shows."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, its stdin and stdout the terminal
            os.chdir(ROOT)
            os.execvpe(sys.executable, [sys.executable, "-m", "shardwise", *argv],
                       {**os.environ, "PYTHONUNBUFFERED": "1"})
        self.seen, self.pos = "", 0  # everything printed; where the last match ended

    def until(self, pattern: str, timeout: float = 120) -> str:
        """What was printed after the last match up to and including ``pattern``'s next match."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.seen[self.pos:])):
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no /{pattern}/ within {timeout} s; the terminal shows:\n"
                                     f"{self.seen[-2000:]}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the command left
                chunk = b""
            if not chunk:
                raise AssertionError(f"the command ended before /{pattern}/:\n{self.seen[-2000:]}")
            self.seen += chunk.decode(errors="replace").replace("\r\n", "\n")
        out = self.seen[self.pos:self.pos + m.end()]
        self.pos += m.end()
        return out

    def say(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\n")

    def exit_code(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        os.kill(self.pid, 9)
        raise AssertionError("the command did not exit")


def _reply(said: str) -> tuple[str, tuple[int, int, int]]:
    """The model's reply and the turn's (run, reused, generated) from one turn's output."""
    reply = said.split("model> ", 1)[1].split("\n[", 1)[0]
    m = STATS.search(said)
    assert m, said
    return reply, (int(m[1]), int(m[2]), int(m[3]))


def test_two_turns_reuse_the_cache_and_answer_as_the_whole_conversation_does(tmp_path: Path):
    folder = tiny_qwen3(tmp_path)
    term = Terminal(["chat", "--hf", str(folder), "--max-new-tokens", "12", "--stats", "--dtype", "fp32"])
    term.until(r"you> ")
    term.say("Who made day 7?")
    first, (ran1, reused1, gen1) = _reply(term.until(r"tok/s\]\nyou> "))
    term.say("And the night?")
    second, (ran2, reused2, gen2) = _reply(term.until(r"tok/s\]\nyou> "))
    # turn 1 runs its whole prompt; turn 2 runs only what follows the first turn's prompt and reply
    assert reused1 == 0 and gen1 >= 1
    assert reused2 >= ran1 and 0 < ran2 < ran1 + gen1 + 12
    # the cached answer is the answer of the whole conversation computed afresh (greedy)
    loaded = load_for_generation("", str(folder), "", "cpu", "fp32")
    conversation = [{"role": "user", "content": "Who made day 7?"}, {"role": "assistant", "content": first},
                    {"role": "user", "content": "And the night?"}]
    ids = prompt_ids(loaded.tokenizer, messages=conversation)
    fresh = generate(loaded.model, ids, Sampling(max_new_tokens=12), loaded.stop, use_cache=False)
    assert second == loaded.tokenizer.decode([t for t in fresh if t not in loaded.stop])
    assert ran2 + reused2 == len(ids)
    # turn 2 runs exactly the tokens its rendering adds to what the cache held after turn 1: turn 1's
    # prompt and every reply token but the last (the last was chosen, never run)
    first_ids = prompt_ids(loaded.tokenizer, messages=conversation[:1])
    replied = generate(loaded.model, first_ids, Sampling(max_new_tokens=12), loaded.stop)
    assert ran1 == len(first_ids) and gen1 == len(replied)
    held = first_ids + replied[:-1]
    assert reused2 == len(os.path.commonprefix([held, ids]))
    # /reset forgets the conversation: the first question gets the first answer, from nothing cached
    term.say("/reset")
    term.until(r"\(a new conversation\)\nyou> ")
    term.say("Who made day 7?")
    again, (_, reused, _) = _reply(term.until(r"tok/s\]\nyou> "))
    assert again == first and reused == 0
    term.say("/exit")
    assert term.exit_code() == 0
