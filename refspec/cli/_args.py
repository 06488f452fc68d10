"""What every ``python -m refspec`` command shares: one-line errors, list options, ``--debug``.

The rules (issue 16):

* a usage error is **one line** on stderr, ``python -m refspec demo: error: <the problem; the
  valid choices>``, and exit status 2, never a traceback; ``--debug`` (anywhere on the command
  line) re-raises instead, with the traceback;
* a failed check (an :class:`~refspec.core.invariants.InvariantError` that escapes a command) is
  one line too, exit status 1, as a failing ``check`` table is;
* every list option is **comma-separated**: ``--page-sizes 1,4,16``, ``--versions v1,v2``,
  ``--sections eager,graph``, ``--only a,b``;
* help texts are plain words (:func:`plain` strips the reST markup of module docstrings).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Callable, Sequence

from refspec.harness.devices import device_problem  # the wording --device and Scenario(device=) share

PROG = "python -m refspec"


class CLIError(Exception):
    """A usage error: printed as one line, exit status 2 (no traceback without ``--debug``)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (raised as :class:`CLIError`) and a ``--debug`` flag."""

    def __init__(self, *args, **kw):
        if "description" in kw and kw["description"]:
            kw["description"] = plain(kw["description"])
        super().__init__(*args, **kw)
        self.add_argument("--debug", action="store_true",
                          help="on an error, show the full Python traceback instead of one line")

    def error(self, message):  # argparse prints the usage and exits; one line is enough
        if message.startswith("unrecognized arguments: "):
            extra = message.split(": ", 1)[1].split()
            flags = [x for x in extra if x.startswith("-")]
            # a stray value, as `--page-sizes 1 4 16` leaves `4 16` (not the value of an unknown flag)
            if any(not x.startswith("-") and (i == 0 or not extra[i - 1].startswith("-")) for i, x in enumerate(extra)):
                message += "; list options take one comma-separated value (e.g. --page-sizes 1,4,16)"
            for flag in flags:  # an unknown option: the nearest known one, if any is near
                near = difflib.get_close_matches(flag.split("=")[0], list(self._option_string_actions), n=1)
                if near:
                    message += f"; did you mean {near[0]}?"
        raise CLIError(f"{message} (see --help)")


def plain(text: str) -> str:
    """Help text without reST markup: ``x`` -> x, :mod:`a.b` / :class:`~a.b.C` -> a.b / C."""
    text = re.sub(r":[a-z]+:`~[\w.]*?\.?(\w+)`", r"\1", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", text)
    return text.replace("``", "")


def _items(text: str, what: str, example: str = "1,4,16") -> list[str]:
    parts = [x.strip() for x in str(text).split(",")]
    if not parts or any(not x for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what} (e.g. {example})")
    return parts


def int_list(least: int = 1, what: str = "ints") -> Callable[[str], list[int]]:
    """An argparse ``type``: ``"1,4,16"`` -> [1, 4, 16]; every item an int >= ``least``."""
    def parse(text: str) -> list[int]:
        out = []
        for x in _items(text, what):
            try:
                n = int(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{x!r} is not an int; give a comma-separated list of "
                                                 f"{what} >= {least} (e.g. 1,4,16)") from None
            if n < least:
                raise argparse.ArgumentTypeError(f"{n} is not a valid value: {what} must be >= {least}")
            out.append(n)
        return out
    parse.__name__ = what  # argparse names the type in "invalid <name> value"
    return parse


def choice_list(choices: Sequence[str], what: str = "names") -> Callable[[str], list[str]]:
    """An argparse ``type``: ``"a,b"`` -> ["a", "b"], each one of ``choices`` (an empty or malformed
    list's error gives the first two choices as the example)."""
    def parse(text: str) -> list[str]:
        out = _items(text, what, ",".join(choices[:2]))
        bad = [x for x in out if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad))}; choose from "
                                             f"{', '.join(choices)} (comma-separated)")
        return out
    parse.__name__ = what
    return parse


def positive_int(least: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: one int >= ``least``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} is not valid: must be an int >= {least}")
        return n
    parse.__name__ = f"int >= {least}"
    return parse


def draft_spec(text: str) -> str:
    """An argparse ``type`` for ``--draft``: ``eagle``, ``eagle3`` (random init), ``eagle:PATH`` /
    ``eagle3:PATH`` (a head file ``train-draft`` wrote; it must exist), ``early-exit`` or
    ``early-exit:K`` (K >= 1)."""
    from pathlib import Path

    name, colon, arg = text.partition(":")
    if name in ("eagle", "eagle3") and colon and arg:
        if not Path(arg).is_file():
            raise argparse.ArgumentTypeError(f"{text!r}: no head file {arg!r} "
                                             f"(python -m refspec train-draft writes one)")
        return text
    ok = (name in ("eagle", "eagle3") and not colon) or (
        name == "early-exit" and (not colon or (arg.isdigit() and int(arg) >= 1)))
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: choose eagle, eagle3, eagle:PATH / eagle3:PATH (a trained head), "
                                         f"early-exit or early-exit:K (K = draft layers, an int >= 1)")
    return text


def budget_spec(text: str) -> str:
    """An argparse ``type`` for ``--max-new-tokens``: one int >= 1 or a comma-separated list of them."""
    int_list(1, "max-new-tokens values")(text)
    return text


def check_draft(spec: str, model) -> None:
    """CLIError unless ``early-exit:K`` fits the loaded model (1 <= K <= its layers) and a head
    file (``eagle:PATH`` / ``eagle3:PATH``) holds that kind of head for this model."""
    name, _, arg = spec.partition(":")
    layers = model.config.num_hidden_layers
    if name == "early-exit" and not 1 <= int(arg or 1) <= layers:
        raise CLIError(f"--draft {spec}: K must lie in 1..{layers} (the target has {layers} layers)")
    if name in ("eagle", "eagle3") and arg:
        from refspec.real.eagle_head import HeadMismatch, real_draft

        try:
            real_draft(spec, model)
        except HeadMismatch as e:
            raise CLIError(f"--draft {spec}: {e}") from None


def check_tree_flags(ns) -> None:
    """``--topk`` / ``--num-draft-tokens`` usage errors (CLIError, exit 2) before a model loads:
    N without k > 1 (SD-010), N past 1 + k + (Sd-1) k^2 (TR-002; N defaults to 2k)."""
    from refspec.core.args import tree_args

    if ns.topk == 1 and ns.num_draft_tokens is not None:
        raise CLIError("--num-draft-tokens needs --topk K > 1 (a chain verifies N = Sd + 1 tokens, SD-010)")
    if ns.topk > 1:
        N = ns.num_draft_tokens or 2 * ns.topk
        try:
            tree_args(ns.topk, ns.num_steps, N)
        except ValueError as e:
            raise CLIError(f"--num-draft-tokens {N} with --topk {ns.topk}, --num-steps {ns.num_steps}: {e}") from None


def device_name(text: str, auto: bool = False) -> str:
    """An argparse ``type`` for ``--device``: ``cpu`` or ``cuda`` (which must exist here), and
    ``auto`` where the command picks one (``functools.partial(device_name, auto=True)``)."""
    problem = device_problem(text, auto)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def run(body: Callable[[list[str]], int], argv: Sequence[str] | None, prog: str) -> int:
    """Run a command's ``body(argv)`` under the error rules of the module doc.

    Returns the exit status: ``body``'s, 2 for a usage error (:class:`CLIError`, a bad file, any
    other exception: one line on stderr), 1 for an InvariantError that escaped, 130 on Ctrl-C, 0
    when the reader of stdout closed the pipe (``cite --list | head``).
    """
    from refspec.core.invariants import InvariantError

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        return int(body(argv) or 0)
    except SystemExit:  # --help / --version, or a command that exits itself
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader closed the pipe; not an error of the command
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter's final flush must not raise again
        return 0
    except Exception as e:  # noqa: BLE001 - the one place every error becomes one line
        if debug:
            raise
        if isinstance(e, InvariantError):
            print(f"{prog}: check failed: {one_line(str(e))}", file=sys.stderr)
            return 1
        msg = str(e) if isinstance(e, CLIError) else f"{type(e).__name__}: {e}"
        hint = "" if isinstance(e, CLIError) else " (rerun with --debug for the traceback)"
        print(f"{prog}: error: {one_line(msg)}{hint}", file=sys.stderr)
        return 2


def one_line(text: str) -> str:
    """``text`` with its line breaks folded into spaces."""
    return " ".join(text.split())


def real_workload(ns):
    """``(questions, budgets, model, load seconds, chat prompts)`` for ``demo`` / ``record``.

    Reads ``ns.prompts``, ``ns.category``, ``ns.max_new_tokens``, ``ns.draft``; the questions and
    budgets are checked before the model is loaded (a bad count fails fast).  Raises CLIError
    (one line, exit 2) for a bad count or category, missing real-input wheels, or a draft the
    model cannot run.
    """
    from refspec.real import RealAssetsMissing
    from refspec.real.run import budgets, chat_prompts, load_target, pick_questions

    try:
        qs = pick_questions(ns.prompts, ns.category)
        max_new = budgets(ns.prompts, ns.max_new_tokens)
    except ValueError as e:
        raise CLIError(f"--prompts {ns.prompts}{f' --category {ns.category}' if ns.category else ''} "
                       f"--max-new-tokens {ns.max_new_tokens}: {e}") from e
    try:
        model, load_s = load_target()
    except RealAssetsMissing as e:
        raise CLIError(str(e)) from e
    check_draft(ns.draft, model)
    return qs, max_new, model, load_s, chat_prompts(qs)
