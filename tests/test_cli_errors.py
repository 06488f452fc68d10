"""Every ``python -m refspec`` usage error is one line on stderr naming the problem (and the
valid choices), exit status 2, no traceback; ``--debug`` shows it; lists are comma-separated;
``--version``; help in plain words for every option; ``check`` output reaches a pipe row by row.

The expected texts are written out here (the valid choices, the offending value), not taken
from the code under test.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from refspec.cli import COMMANDS, main
from refspec.real import assets

ROOT = Path(__file__).resolve().parents[1]
TRACE = str(ROOT / "benchmarks" / "traces" / "mtbench_smollm2.json")
no_real = pytest.mark.skipif(bool(assets.missing_reason()), reason=str(assets.missing_reason()))


def _files(tmp: Path) -> dict:
    (tmp / "bad.json").write_text('{"format": "refspec-trace/1", "config": ')
    (tmp / "list.json").write_text("[1, 2, 3]")
    (tmp / "bigint.json").write_text('{"format": "refspec-trace/1", "x": ' + "9" * 5001 + "}")
    (tmp / "other.json").write_text(json.dumps({"format": "something-else/2"}))
    (tmp / "norows.json").write_text(json.dumps({"env": "x"}))
    (tmp / "folder").mkdir()
    return {k: str(tmp / k) for k in ("bad.json", "bigint.json", "list.json", "other.json", "norows.json", "folder")}


# (argv, words the one line must contain); {name} is a file made by _files
CASES = [
    # the four
    (["demo", "--bug", "nope"], ["--bug", "'nope'", "seed-page-table", "verify-as-decode"]),
    (["replay", "missing.json"], ["missing.json", "not found", "refspec record"]),
    (["replay", "{bad.json}"], ["bad.json", "not JSON"]),
    (["replay", "{bigint.json}"], ["trace", "bigint.json", "not JSON"]),
    (["demo", "--page-sizes", "0"], ["--page-sizes", "0", ">= 1"]),
    # top level
    ([], ["required", "COMMAND"]),
    (["nope"], ["'nope'", "info", "check", "replay", "mutants"]),
    (["--bogus"], ["COMMAND"]),
    # info
    (["info", "--bogus"], ["unrecognized arguments: --bogus"]),
    # check
    (["check", "--page-sizes", "0"], ["--page-sizes", ">= 1"]),
    (["check", "--page-sizes", "1,four"], ["'four'", "comma-separated"]),
    (["check", "--page-sizes", "1,,4"], ["comma-separated"]),
    (["check", "--page-sizes", "1", "4"], ["unrecognized arguments: 4", "comma-separated"]),
    (["check", "--sections", "eager,nope"], ["'nope'", "contract", "eager", "graph", "loops"]),
    (["check", "--device", "gpu"], ["'gpu'", "cpu", "cuda"]),
    (["check", "--quick", "yes"], ["unrecognized arguments: yes"]),
    # bench
    (["bench", "--sections", "kernels"], ["'kernels'", "kernel", "scale", "metadata", "loop"]),
    (["bench", "--device", "tpu"], ["'tpu'", "cpu", "cuda"]),
    (["bench", "--plot", "missing.json"], ["--plot", "missing.json", "no such file"]),
    (["bench", "--plot", "{bad.json}"], ["--plot", "not a bench.json"]),
    (["bench", "--plot", "{norows.json}"], ["--plot", "not a bench.json"]),
    (["bench", "--out", "{bad.json}"], ["--out", "is a file", "folder"]),
    # demo (all refused before any model is loaded)
    (["demo", "--versions", "v1,v3"], ["'v3'", "v1", "v2"]),
    (["demo", "--num-draft-tokens", "4"], ["--num-draft-tokens", "--topk", "SD-010"]),
    (["demo", "--topk", "2", "--bug", "seed-page-table"], ["--bug", "--topk"]),
    (["demo", "--topk", "2", "--num-draft-tokens", "99"], ["--num-draft-tokens 99", "TR-002"]),
    (["demo", "--draft", "medusa"], ["'medusa'", "eagle", "early-exit:K"]),
    (["demo", "--draft", "early-exit:0"], ["early-exit:0", "early-exit:K"]),
    (["demo", "--prompts", "0"], ["--prompts", ">= 1"]),
    (["demo", "--prompts", "many"], ["--prompts", "'many'", "not an int"]),
    (["demo", "--category", "poetry"], ["'poetry'", "writing", "math", "humanities"]),
    (["demo", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["demo", "--max-new-tokens", "8,-1"], ["--max-new-tokens", "-1"]),
    (["demo", "--prompts", "2", "--max-new-tokens", "5,4,3"], ["--max-new-tokens 5,4,3", "3 max_new_tokens values",
                                                                "2 requests"]),
    (["demo", "--num-steps", "0"], ["--num-steps", ">= 1"]),
    (["demo", "--threads", "x"], ["--threads", "'x'"]),
    (["demo", "--device", "tpu"], ["'tpu'", "auto, cpu or cuda"]),
    # record
    (["record"], ["required", "--out"]),
    (["record", "--out", "{folder}"], ["--out", "is a folder"]),
    (["record", "--out", "t.json", "--version", "v3"], ["--version", "'v3'", "v1", "v2"]),
    (["record", "--out", "t.json", "--page-size", "0"], ["--page-size", ">= 1"]),
    (["record", "--out", "t.json", "--max-batch", "0"], ["--max-batch", ">= 1"]),
    (["record", "--out", "t.json", "--draft", "big"], ["'big'", "eagle"]),
    # replay
    (["replay"], ["required", "trace"]),
    (["replay", "{list.json}"], ["list.json", "JSON object", "refspec record"]),
    (["replay", "{other.json}"], ["format", "something-else/2", "refspec-trace/1"]),
    (["replay", "{norows.json}"], ["norows.json"]),
    (["replay", "{folder}"], ["cannot read", "folder"]),
    (["replay", TRACE, "--page-sizes", "0"], ["--page-sizes", ">= 1"]),
    (["replay", TRACE, "--versions", "v9"], ["'v9'", "v1", "v2"]),
    (["replay", TRACE, "--device", "gpu"], ["'gpu'", "cpu", "cuda"]),
    (["replay", TRACE, "--dtype", "fp8"], ["'fp8'", "bfloat16", "float16", "float32"]),
    (["replay", TRACE, "--drafter", "oracle"], ["'oracle'", "perfect", "model"]),
    (["replay", TRACE, "--drafter", "model", "--dtype", "bfloat16"], ["--drafter model", "float32"]),
    (["replay", TRACE, "--seed", "x"], ["--seed", "'x'"]),
    (["replay", TRACE, "--num-layers", "0"], ["--num-layers", ">= 1"]),
    (["replay", TRACE, "--out", "{folder}"], ["--out", "is a folder"]),
    (["replay", TRACE, "--no-progess"], ["unrecognized arguments: --no-progess", "did you mean --no-progress?"]),
    # mutants
    (["mutants", "--only", "nope"], ["'nope'", "seed-page-table"]),
    (["mutants", "--only", "seed-page-table", "verify-as-decode"], ["unrecognized arguments", "comma-separated"]),
    (["mutants", "--device", "gpu"], ["'gpu'", "cpu", "cuda"]),
    # conformance (refused before anything is installed)
    (["conformance", "--pins", "0.4.0"], ["'0.4.0'", "predates the FA3 backend", "0.4.4.post2", "0.5.23"]),
    (["conformance", "--sglang", "0.5.23,"], ["empty item", "comma-separated"]),
    (["conformance", "--sglang", "no-such-thing"], ["'no-such-thing'", "release version", "source tree"]),
    (["conformance", "--page-sizes", "3"], ["--page-sizes", "[3]", "1,2,4,8,16,64"]),
    (["conformance", "--modes", "decode,prefill"], ["'prefill'", "draft_extend_v2"]),
    (["conformance", "--variant", "nope"], ["--variant", "'nope'", "seed-page-table"]),
    (["conformance", "--topks", "3"], ["--topks", "[3]", "2,4,8"]),
    (["conformance", "--topks", "1"], ["--topks", "1", ">= 2"]),
    (["conformance", "--pin", "0.5.23", "0.5.12.post1"], ["unrecognized arguments", "comma-separated"]),
    (["conformance", "--baseline", "0.5.23"], ["--baseline", "exactly one --sglang SPEC", "got none"]),
    (["conformance", "--baseline", "0.5.23", "--sglang", "0.5.23,0.5.14"], ["--baseline", "got 2: 0.5.23,0.5.14"]),
    # train-draft: refused before any data or model is read (--data names no file: a later refusal would say so)
    (["train-draft", "--kind", "eagle3", "--aux-layers", "2,x", "--data", "none.npz"], ["--aux-layers", "'2,x'"]),
    (["train-draft", "--kind", "eagle3", "--aux-layers", "2,2", "--data", "none.npz"], ["aux_layers (2, 2)",
                                                                                         "strictly increasing"]),
    (["train-draft", "--kind", "eagle3", "--aux-layers", "27,2", "--data", "none.npz"], ["aux_layers (27, 2)"]),
    (["train-draft", "--kind", "eagle3", "--aux-layers", "5", "--data", "none.npz"], ["aux_layers (5,)", "two"]),
    (["train-draft", "--aux-layers", "2,15", "--data", "none.npz"], ["--aux-layers needs --kind eagle3"]),
    (["train-draft", "--unroll", "0", "--data", "none.npz"], ["--unroll", ">= 1"]),
    (["train-draft", "--unroll", "4", "--data", "none.npz"], ["unroll=4", "kind 'eagle'", "--kind eagle3"]),
    (["train-draft", "--lr", "nan", "--data", "none.npz"], ["lr must be a finite number"]),
    (["train-draft", "--lr", "-1", "--data", "none.npz"], ["lr must be > 0"]),
    (["train-draft", "--max-seconds", "-5", "--data", "none.npz"], ["--max-seconds", "> 0"]),
    (["train-draft", "--train-seconds", "0", "--data", "none.npz"], ["--train-seconds", "> 0"]),
]
if not torch.cuda.is_available():
    CASES += [(["check", "--device", "cuda"], ["no CUDA device"]), (["mutants", "--device", "cuda"], ["no CUDA"]),
              (["replay", TRACE, "--device", "cuda"], ["no CUDA"])]


def _one_line_error(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(a)[:60] or "(nothing)" for a, _ in CASES])
def test_a_usage_error_is_one_line_and_exit_2(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative names (missing.json, t.json) resolve in an empty folder
    files = _files(tmp_path)
    argv = [files[a[1:-1]] if a.startswith("{") else a for a in argv]
    rc, out, err = _one_line_error(capsys, argv)
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and out == ""
    assert lines[0].startswith("python -m refspec") and "error:" in lines[0], lines[0]
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    assert not (tmp_path / "t.json").exists()  # refused before anything was written


@no_real
@pytest.mark.parametrize("argv,words", [
    (["demo", "--prompts", "99"], ["--prompts 99", "80 available"]),
    (["demo", "--prompts", "11", "--category", "math"], ["--category math", "10 available"]),
    (["demo", "--draft", "early-exit:31", "--no-progress"], ["early-exit:31", "1..30"]),
])
def test_a_usage_error_found_with_the_real_assets_is_one_line(argv, words, capsys):
    rc, out, err = _one_line_error(capsys, argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err


def _python(*args, env_extra=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


@pytest.mark.parametrize("argv", [["demo", "--bug", "nope"], ["replay", "missing.json"]])
def test_a_real_process_exits_2_with_one_line(argv):
    p = _python("-m", "refspec", *argv)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr


def test_debug_shows_the_traceback():
    p = _python("-m", "refspec", "replay", "missing.json", "--debug")
    assert p.returncode != 0 and "Traceback" in p.stderr and "missing.json" in p.stderr
    q = _python("-m", "refspec", "--debug", "replay", "missing.json")  # before the command too
    assert q.returncode != 0 and "Traceback" in q.stderr


def test_version(capsys):
    from refspec import __version__

    assert __version__ == "0.1.0"
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "refspec 0.1.0"
    p = _python("-m", "refspec", "--version")
    assert p.returncode == 0 and p.stdout.strip() == "refspec 0.1.0"


def _parsers(monkeypatch):
    """Each command's ArgumentParser, caught as it parses ``--help``."""
    from refspec.cli import _args

    seen = {}
    real = _args.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        seen[self.prog] = self
        return real(self, args, namespace)
    monkeypatch.setattr(_args.ArgumentParser, "parse_args", grab)
    helps = {}
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        prog = f"python -m refspec {name}"
        assert prog in seen, (f"{name}: build its parser with refspec.cli._args.ArgumentParser (prog {prog!r}) "
                              f"and wrap main in refspec.cli._args.run: one-line errors, --debug, plain help")
        helps[name] = seen[prog]
    return helps


def test_every_option_has_plain_help(monkeypatch, capsys):
    for name, parser in _parsers(monkeypatch).items():
        for action in parser._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        text = parser.format_help()
        for markup in ("``", ":mod:", ":class:", ":func:", ":data:", ":meth:"):
            assert markup not in text, f"{name} --help shows {markup!r}:\n{text}"
    top = capsys.readouterr().out
    assert "``" not in top and ":mod:" not in top


def test_list_options_are_comma_separated(monkeypatch, capsys):
    """Every option whose help says it takes several values parses "a,b" (one syntax)."""
    lists = {(n, o) for n, p in _parsers(monkeypatch).items() for a in p._actions for o in a.option_strings
             if "comma-separated" in (a.help or "")}
    assert {("check", "--page-sizes"), ("check", "--sections"), ("demo", "--page-sizes"), ("demo", "--versions"),
            ("replay", "--page-sizes"), ("replay", "--versions"), ("bench", "--sections"),
            ("mutants", "--only"), ("conformance", "--pins"), ("conformance", "--page-sizes"),
            ("conformance", "--modes"), ("conformance", "--topks")} <= lists
    for _, p in _parsers(monkeypatch).items():
        for a in p._actions:  # options; a positional may take several words (cite ID ID ...)
            assert not a.option_strings or a.nargs in (None, 0), \
                f"{p.prog} {a.option_strings}: nargs={a.nargs!r}, use one comma-separated value"


def test_check_output_reaches_a_pipe_row_by_row(tmp_path):
    """Stdout piped (a CI log): the first row arrives while the check is still running.  The
    child's only section yields a row and then waits for the parent to have read it."""
    go = tmp_path / "go"
    child = textwrap.dedent(f"""
        import pathlib, time
        from refspec.cli import check
        def section(device, page_sizes, quick):
            yield dict(section="contract", mode="probe", P=1, provider="emulator", check="c", result="pass",
                       worst="bitwise")
            for _ in range(600):  # the parent creates the file once it has read the row
                if pathlib.Path({str(go)!r}).exists():
                    return
                time.sleep(0.1)
            raise SystemExit("the row never reached the pipe")
        check.SECTIONS = {{"contract": section}}
        raise SystemExit(check.main(["--sections", "contract"]))
    """)
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        lines = [p.stdout.readline()]  # the legend (issue 43), then the header, the rule and the row
        while lines[-1] and not lines[-1].startswith("section "):
            lines.append(p.stdout.readline())
        lines += [p.stdout.readline() for _ in range(2)]
        assert lines[-1].split()[:2] == ["contract", "probe"], lines
        go.write_text("read")
        rest, err = p.communicate(timeout=60)
    finally:
        p.kill() if p.poll() is None else None
    assert p.returncode == 0, err
    assert rest.strip() == "1 checks: 1 pass, 0 FAIL, 0 skip"



def test_a_reader_closing_the_pipe_is_not_an_error(monkeypatch, capsys):
    """``cite --list | head -1``: the reader went away; the command prints no error and exits 0."""
    from refspec.cli._args import run

    def body(argv):
        raise BrokenPipeError(32, "Broken pipe")  # what print() raises once the reader has closed stdout

    monkeypatch.setattr(sys, "stdout", io.StringIO())  # the handler points stdout at devnull; restored after
    assert run(body, [], "refspec cite") == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv,line", [
    # an unknown option: no hint about list values (before: "; list options take one comma-separated value ...")
    (["info", "--bogus"], "python -m refspec info: error: unrecognized arguments: --bogus (see --help)"),
    (["check", "--pagesizes", "4"], "python -m refspec check: error: unrecognized arguments: --pagesizes 4; "
     "did you mean --page-sizes? (see --help)"),
    # a stray value (as `--page-sizes 1 4` leaves `4`): the list hint
    (["check", "--page-sizes", "1", "4"], "python -m refspec check: error: unrecognized arguments: 4; list options "
     "take one comma-separated value (e.g. --page-sizes 1,4,16) (see --help)"),
], ids=["unknown-flag", "near-flag-and-value", "stray-value"])
def test_unrecognized_arguments_hint_fits_the_argument(argv, line, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == line + "\n"
