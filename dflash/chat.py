"""python -m dflash.chat: a multi-turn chat in the terminal, DFlash-accelerated (or one piped prompt, answered).

    python -m dflash.chat                                    # the bundled reference pair, offline
    python -m dflash.chat --model Qwen/Qwen3-8B              # drafter from the registry (python -m dflash.models)
    echo "Explain KV caches" | python -m dflash.chat --model Qwen/Qwen3-8B

Every turn re-renders the whole conversation with the tokenizer's chat template (a model without one gets the
turns appended as plain text) and hands it to the backend, whose prefill keeps the longest common prefix of the
target and drafter caches: only the new turn is computed ("prefill N new tokens (reused M)"). Templates that
rewrite history (Qwen3 drops old <think> blocks) re-prefill from the first rewritten token.

Ctrl-C stops a reply at the end of the current draft/verify cycle; the part already shown stays in the
conversation (and in the cache). A second Ctrl-C stops at once and resets the caches.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass, field

from . import cli, hub
from .core.errors import DFlashError
from .core.output import cycle_counts, mean_acceptance_length, per_position_acceptance
from .core.sampling import common_prefix

PROMPT = ">> "
HELP = """commands:
  /reset   start a new conversation (keeps --system; clears /stats)
  /stats   what the session measured: tau, acceptance per draft position, tokens/s, cycles drafted
  /help    this list
  /exit    quit (also /quit or Ctrl-D)
Ctrl-C stops a reply; the part already shown stays in the conversation."""
HINT = ("bundled reference pair: a small model of Python source (try: def fibonacci(n):). For a real model: "
        "--model Qwen/Qwen3-8B (python -m dflash.models lists the known pairs)")


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.chat", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_args(p)
    cli.add_sampling_args(p)
    p.add_argument("--system", help="system message")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="thinking", action="store_const", const=True, default=None,
                       help="pass enable_thinking=True to the chat template (Qwen3 and similar)")
    think.add_argument("--disable-thinking", dest="thinking", action="store_const", const=False,
                       help="pass enable_thinking=False to the chat template")
    p.add_argument("--max-context", type=int,
                   help="drop the oldest turns to keep prompt + reply within N tokens (default: the model's context)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens: got {args.max_new_tokens}, expected >= 1")
    if args.max_context is not None and args.max_context < 2:
        raise DFlashError(f"--max-context: got {args.max_context}, expected >= 2")
    return args


class Conversation:
    """The turns so far as (user, reply) pairs, rendered to prompt ids with the chat template (or, without one, as
    plain text: each user turn on a new line, its reply continuing it).

    The last reply is kept as the very tokens the model produced, so the cache covers it: while the template only
    appends (the rendered history still starts with the text the model saw and wrote), the next prompt is those
    ids plus the rendered tail; a template that rewrites history (or a reply cut by a stop string) falls back to
    rendering everything afresh."""

    def __init__(self, tokenizer, system: str | None = None, thinking: bool | None = None):
        self.tokenizer, self.system, self.thinking = tokenizer, system, thinking
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.turns: list[tuple[str, str]] = []
        self.exact: tuple[str, list[int]] | None = None  # (text, ids) through the last reply, as generated

    def text(self, user: str, turns: list[tuple[str, str]]) -> str:
        if self.templated:
            messages = [{"role": "system", "content": self.system}] if self.system else []
            for u, r in turns:
                messages += [{"role": "user", "content": u}, {"role": "assistant", "content": r}]
            kwargs = {} if self.thinking is None else {"enable_thinking": self.thinking}
            return self.tokenizer.apply_chat_template(messages + [{"role": "user", "content": user}],
                                                      add_generation_prompt=True, tokenize=False, **kwargs)
        text = self.system + "\n" if self.system else ""
        for u, r in turns + [(user, "")]:
            if text and not text.endswith("\n"):
                text += "\n"
            text += u + r
        return text

    def encode(self, text: str, start: bool) -> list[int]:
        # a rendered template carries its own BOS; plain text gets the tokenizer's at the start only
        return self.tokenizer(text, add_special_tokens=start and not self.templated)["input_ids"]

    def ids(self, user: str, turns: list[tuple[str, str]] | None = None) -> list[int]:
        exact = self.exact if turns is None else None
        text = self.text(user, self.turns if turns is None else turns)
        if exact and text.startswith(exact[0]):
            return exact[1] + self.encode(text[len(exact[0]):], start=False)
        return self.encode(text, start=True)

    def add(self, user: str, prompt_ids: list[int], reply: str, reply_ids: list[int]) -> None:
        prompt = self.text(user, self.turns)
        self.turns.append((user, reply))
        same = self.tokenizer.decode(reply_ids, skip_special_tokens=False) == reply
        self.exact = (prompt + reply, list(prompt_ids) + list(reply_ids)) if same else None

    def drop(self, n: int) -> None:
        """Forget the oldest n turns (or all of them)."""
        del self.turns[:n]
        self.exact = None if n else self.exact

    def fit(self, user: str, max_context: int | None, reserve: int) -> tuple[list[int], int]:
        """(prompt ids, oldest turns to drop) so that prompt + reserve fits max_context (when it can)."""
        ids, drop = self.ids(user), 0
        while max_context and len(ids) + reserve > max_context and drop < len(self.turns):
            drop += 1
            ids = self.ids(user, self.turns[drop:])
        return ids, drop


@dataclass
class Stats:
    replies: int = 0
    tokens: int = 0
    lengths: list[int] = field(default_factory=list)  # committed tokens per draft/verify cycle
    decode_tokens: int = 0  # tokens after each reply's first (which comes out of the prefill)
    decode_seconds: float = 0.0
    prefilled: int = 0
    reused: int = 0
    verified: list[int] = field(default_factory=list)  # draft tokens verified per cycle (the budgets chosen)
    draft_forwards: list[bool] = field(default_factory=list)  # per cycle: whether it ran a draft forward


class StopOnSigint:
    """While a reply streams, the first Ctrl-C only asks it to stop after the current cycle (the caches stay
    consistent); a second one raises KeyboardInterrupt at once."""

    def __enter__(self):
        self.requested = False
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave Ctrl-C alone
            self._old = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


class Chat:
    def __init__(self, pipe, args, out=None, err=None):
        self.pipe, self.args = pipe, args
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.sampling = cli.sampling_from(args, pipe.engine.info.vocab_size)
        self.conv = Conversation(pipe.tokenizer, args.system, args.thinking)
        self.max_context = args.max_context or pipe.engine.max_context
        self.stats = Stats()

    def context_name(self) -> str:
        """The context bound in the words of whoever set it: the user's flag, else the target's own."""
        if self.args.max_context:
            return f"--max-context {self.max_context}"
        return f"the target's context of {self.max_context} tokens"

    def note(self, line: str) -> None:
        """A side line (summaries, notes) on stderr, dimmed on a terminal."""
        self.out.flush()
        dim = self.err.isatty()
        print(f"\033[2m{line}\033[0m" if dim else line, file=self.err, flush=True)

    # ---- one turn ------------------------------------------------------------------------------------------------
    def turn(self, user: str) -> str:
        args, backend = self.args, self.pipe.engine
        reserve = min(args.max_new_tokens, self.max_context // 2) if self.max_context else 0
        ids, drop = self.conv.fit(user, self.max_context, reserve)
        max_new = args.max_new_tokens
        if self.max_context:
            if len(ids) >= self.max_context:
                more = "; send a shorter message" + (" or raise --max-context" if args.max_context else "")
                raise DFlashError(f"this message is {len(ids)} tokens in the chat template, more than "
                                  f"{self.context_name()}{more}")
            max_new = min(max_new, self.max_context - len(ids))
        self.conv.drop(drop)
        reused = min(common_prefix(backend.cached_tokens, ids), len(ids) - 1)  # prefill keeps >= 1 token to run
        gen = self.pipe.stream(ids, max_new_tokens=max_new, sampling=self.sampling, stop=args.stop)

        steps, parts, token_parts, interrupted = [], [], [], None
        t0 = time.perf_counter()
        t1 = None
        with StopOnSigint() as sigint:
            try:
                for inc in gen:
                    t1 = t1 or time.perf_counter()
                    steps.append(len(inc.tokens))
                    token_parts.append(inc.tokens)
                    parts.append(inc.text)
                    self.out.write(inc.text)
                    self.out.flush()
                    if sigint.requested:
                        interrupted = "stopped"
                        break
            except KeyboardInterrupt:  # mid-cycle: the caches may be half-updated
                interrupted = "stopped at once, caches reset"
                backend.reset()
        t2 = time.perf_counter()
        text = "".join(parts)
        tokens = [t for inc_tokens in token_parts for t in inc_tokens]
        while tokens and tokens[-1] in self.pipe.eos_token_ids:  # the template writes its own end of turn
            tokens.pop()
        if interrupted == "stopped":  # the stream held back a cut character: the reply is its tokens' whole text, so
            # that the next turn's prompt starts with the very ids the cache holds
            whole = self.conv.tokenizer.decode(tokens, skip_special_tokens=False)
            if whole.startswith(text) and len(whole) > len(text):
                self.out.write(whole[len(text):])
                text = whole
        if text and not text.endswith("\n"):
            self.out.write("\n")
        if interrupted:
            self.out.write("[interrupted]\n")

        # the prefill's token is not a cycle; every later increment is one cycle (its committed tokens)
        lengths = gen.result.acceptance_lengths if gen.result else steps[1:]
        n = sum(steps)
        prefill_s, decode_s = (t1 or t2) - t0, t2 - (t1 or t2)
        s = self.stats
        s.replies += 1
        s.tokens += n
        if gen.result:  # (a stopped reply's cycles are not known one by one: its tokens count, its cycles not)
            s.lengths += gen.result.acceptance_lengths
            s.verified += gen.result.verified
            s.draft_forwards += gen.result.draft_forwards
        s.decode_tokens += max(n - 1, 0)
        s.decode_seconds += decode_s
        s.prefilled += len(ids) - reused
        s.reused += reused
        tps = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        line = (f"tau {mean_acceptance_length(lengths):.2f} | {tps:.1f} tok/s | {n} tokens | "
                f"prefill {len(ids) - reused} new tokens (reused {reused}) {prefill_s * 1000:.0f} ms")
        if drop:
            line += f" | dropped the {drop} oldest turn(s) to fit {self.context_name()}"
        if max_new < args.max_new_tokens:
            line += f" | capped at {max_new} tokens: the context holds {self.max_context}"
        if interrupted:
            line += f" | {interrupted}"
        self.note(line)
        if text or not interrupted:
            self.conv.add(user, ids, text, tokens)
        return text

    # ---- /stats --------------------------------------------------------------------------------------------------
    def report(self) -> list[str]:
        """The session's numbers as its replies measured them: nothing is run or timed here, so /stats answers at
        once (a keystroke typed meanwhile never becomes the next message)."""
        s, backend = self.stats, self.pipe.engine
        if not s.replies:
            return ["no replies yet"]
        per_token = s.decode_seconds / s.decode_tokens if s.decode_tokens else 0.0
        lines = [f"{s.replies} replies, {s.tokens} tokens, {len(s.lengths)} cycles; decode "
                 f"{1 / per_token if per_token else 0:.1f} tok/s; prefill computed {s.prefilled} tokens, "
                 f"reused {s.reused} from the cache"]
        b = backend.block_size
        if b <= 1:
            return lines + ["no drafter (--no-draft): this is the autoregressive baseline"]
        if not s.lengths:
            return lines + ["no finished cycle to report (every reply was stopped)"]
        tau = mean_acceptance_length(s.lengths)
        rule = backend.accept_rules[0] if backend.accept_rules else "greedy"
        drafted = [n for n, forward in zip(s.lengths, s.draft_forwards) if forward]
        plain = [n for n, forward in zip(s.lengths, s.draft_forwards) if not forward]
        lines.append(f"tau {tau:.2f} tokens per cycle (block {b}; acceptance rule {rule})")
        if drafted:
            lines.append(f"acceptance by draft position 1..{b - 1}, over the cycles that drafted: " +
                         " ".join(f"{r:.2f}" for r in per_position_acceptance(drafted, b)))
        counts = cycle_counts(s.verified, s.draft_forwards)
        line = f"verify {backend.verify_mode}: {counts.drafted} of {counts.cycles} cycles ran a draft forward"
        if drafted:
            budgets = sorted(counts.verified_when_drafted)
            line += (f" and committed {mean_acceptance_length(drafted):.2f} tokens each, verifying "
                     f"{sum(budgets) / len(budgets):.1f} of its tokens on average (min {budgets[0]}, median "
                     f"{budgets[len(budgets) // 2]}, max {budgets[-1]})")
        if counts.drafted_verifying_none:
            line += f"; {counts.drafted_verifying_none} of them verified none (no proposal was worth its verify)"
        if plain:
            line += (f"; {len(plain)} ran none (the drafter paused) and committed "
                     f"{mean_acceptance_length(plain):.2f} tokens each")
        lines.append(line + (f"; {backend.verify_note}" if backend.verify_note else ""))
        share = sum(drafted) / sum(s.lengths)
        lines.append(f"speedup over target-only decoding: at most {tau:.2f}x, were every cycle to cost one target "
                     f"step (a bound from tokens per cycle, not a measurement; python -m dflash.bench measures "
                     f"one); {share:.0%} of the tokens came from cycles that drafted")
        return lines

    # ---- the loop ------------------------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False means exit."""
        name = line.split()[0].lower()
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.conv.drop(len(self.conv.turns))
            self.stats = Stats()
            self.note("new conversation")
        elif name == "/stats":
            for x in self.report():
                print(x, file=self.out)
        elif name == "/help":
            print(HELP, file=self.out)
        else:
            self.note(f"unknown command {name}; /help lists them")
        return True

    def repl(self) -> int:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                self.note("(Ctrl-D or /exit quits)")
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return 0
                continue
            if not line.strip():
                continue
            try:
                self.turn(line.strip())
            except DFlashError as e:
                self.note(f"error: {e}")


def describe(pipe, args) -> str:
    target = args.model or "bundled reference target"
    draft = "no drafter"
    if pipe.draft_dir is not None:
        name = args.draft or (hub.draft_for(str(args.model)) if args.model else "bundled reference drafter")
        draft = f"{name} (block {pipe.engine.block_size})"
    mode = "chat template" if getattr(pipe.tokenizer, "chat_template", None) else "plain completion (no chat template)"
    return f"dflash chat | {pipe.backend_name} | {target} + {draft} | {mode}"


def main(argv=None) -> int:
    args = parse_args(argv)
    cli.restart_if_mlx(args)  # a restart after reading a piped prompt would leave the new process an empty stdin
    interactive = sys.stdin.isatty()
    prompt = ""
    if not interactive:
        prompt = sys.stdin.read().strip()
        if not prompt:
            raise DFlashError("stdin: empty prompt; pipe a message (echo 'hi' | python -m dflash.chat) or run "
                              "python -m dflash.chat in a terminal")
    pipe = cli.load_pipeline(args)
    chat = Chat(pipe, args)
    if args.thinking is not None and not chat.conv.templated:
        chat.note("--enable-thinking/--disable-thinking: ignored, this tokenizer has no chat template")
    if not interactive:
        chat.turn(prompt)
        return 0
    chat.note(describe(pipe, args) + " | /help, Ctrl-D quits")
    if args.model is None:
        chat.note(HINT)
    return chat.repl()


if __name__ == "__main__":
    sys.exit(cli.run(main))
