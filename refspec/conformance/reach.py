"""Which configurations a release's own code refuses or silently rewrites (worker subprocess only).

A job is a configuration (page size P, top-k k, steps S, N draft tokens, EAGLE, the FA3 backend)
that a server would have to accept before its backend ever builds metadata for it.  Releases
guard those choices in their own code: ``ServerArgs`` rewrites top-k to 1 when ``page_size > 1``
(0.4.5.post3 .. 0.4.8: "speculative_eagle_topk is adjusted to 1 when page_size > 1") or refuses
the pair for every paged backend but FlashInfer (0.5.2 .. 0.5.5.post3: a ``ValueError``), and the
EAGLE worker refuses it (0.4.7: ``NotImplementedError("page_size > 1 and top_k > 1 are not
supported.")``).  A job such a guard refuses or rewrites is *not reachable upstream*: it is not
compared, and the report names the guard's line.

The guards are read from the release's own files (:func:`scan`: every ``raise`` / ``assert``
and every rewrite of ``speculative_eagle_topk`` -- an assignment, or a ``declare_resolution``
keyword -- whose enclosing ``if`` chain, or whose own test, mentions top-k), in the methods of
``ServerArgs`` (``server_args.py``), the EAGLE-family hooks of ``arg_groups/speculative_hook.py``
(newer releases) and the ``EAGLEWorker`` methods of ``speculative/eagle_worker.py``; each guard's
``if`` chain is then *evaluated by Python on the job's own ServerArgs* (:func:`verdict`), with the
release's module globals, so the condition is upstream's expression, not a transcription.  A
condition that cannot be evaluated on a CPU (it calls something the worker stubs) is counted as
undetermined and never refuses.  A worker guard refuses only where the release has no spec-v2
worker (``eagle_worker.py`` is then the one path).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import ast
import builtins
import os
from dataclasses import dataclass, field
from functools import lru_cache

SERVER_ARGS = "sglang/srt/server_args.py"
HOOKS = "sglang/srt/arg_groups/speculative_hook.py"
WORKER = "sglang/srt/speculative/eagle_worker.py"
WORKER_V2 = "sglang/srt/speculative/eagle_worker_v2.py"
#: the configured field whose refusal or rewrite the scan looks for (the tree modes' dimension)
TOPK = "speculative_eagle_topk"


@dataclass(frozen=True)
class Guard:
    """One guarding statement: ``kind`` ``"refuses"`` (raise, failed assert) or ``"rewrites"``
    (top-k set to ``value``); ``chain``: the source of each enclosing ``if`` test with whether the
    statement is in its body (True) or its ``else`` (False); ``test``: an assert's own test;
    ``owner``: ``"server_args"`` (``self``, ``cfg``, ``view``, ``server_args`` are the job's
    ServerArgs) or ``"worker"`` (``self`` is the EAGLE worker, built from its ``__init__``)."""

    file: str
    line: int
    func: str
    kind: str
    owner: str
    chain: tuple[tuple[str, bool], ...]
    test: str = ""
    value: str = ""
    what: str = ""
    consts: tuple[tuple[str, str], ...] = field(default=())  #: the function's constant locals (name, source)


def _mentions_topk(src: str) -> bool:
    return "topk" in src or "top_k" in src


def _walk(func: ast.AST, text: str, rel: str, owner: str, name: str) -> list[Guard]:
    out: list[Guard] = []
    consts = tuple((t.id, ast.unparse(n.value)) for n in ast.walk(func)
                   if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Constant, ast.Tuple, ast.List))
                   for t in n.targets if isinstance(t, ast.Name))

    def visit(stmts, chain):
        for st in stmts:
            if isinstance(st, ast.If):
                test = ast.unparse(st.test)
                visit(st.body, chain + ((test, True),))
                visit(st.orelse, chain + ((test, False),))
                continue
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            seg = ast.unparse(st)
            relevant = any(_mentions_topk(t) for t, _ in chain)
            if isinstance(st, ast.Raise) and relevant:
                out.append(Guard(rel, st.lineno, name, "refuses", owner, chain, what=seg.strip(), consts=consts))
            elif isinstance(st, ast.Assert) and (relevant or _mentions_topk(seg)):
                out.append(Guard(rel, st.lineno, name, "refuses", owner, chain,
                                 test=ast.unparse(st.test), what=seg.strip(), consts=consts))
            else:
                for n in ast.walk(st):
                    value = None
                    if isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == TOPK
                                                         for t in n.targets):
                        value = n.value
                    elif isinstance(n, ast.Call):
                        value = next((k.value for k in n.keywords if k.arg == TOPK), None)
                    if value is not None and chain:
                        out.append(Guard(rel, st.lineno, name, "rewrites", owner, chain,
                                         value=ast.unparse(value),
                                         what=seg.strip().split("\n")[0], consts=consts))
            for attr in ("body", "orelse", "finalbody", "handlers"):  # with / try / for blocks: the same chain
                inner = getattr(st, attr, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], (ast.stmt, ast.excepthandler)):
                    visit([x for h in inner for x in (h.body if isinstance(h, ast.excepthandler) else [h])], chain)

    visit(func.body, ())
    return out


@lru_cache(maxsize=8)
def scan(site: str) -> tuple[Guard, ...]:
    """Every guard of the code under ``site`` (module doc), in file and line order."""
    out: list[Guard] = []
    for rel, cls, owner in ((SERVER_ARGS, "ServerArgs", "server_args"), (HOOKS, None, "server_args"),
                            (WORKER, "EAGLEWorker", "worker")):
        path = os.path.join(site, rel)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text, path)
        for node in tree.body:
            if cls is None and isinstance(node, ast.FunctionDef) and node.name.startswith("_handle_eagle"):
                out += _walk(node, text, rel, owner, node.name)
            elif isinstance(node, ast.ClassDef) and node.name == cls:
                for m in node.body:
                    if isinstance(m, ast.FunctionDef):
                        out += _walk(m, text, rel, owner, f"{cls}.{m.name}")
    return tuple(out)


@lru_cache(maxsize=8)
def worker_fields(site: str) -> tuple[tuple[str, str], ...]:
    """``EAGLEWorker.__init__``'s ``self.<name> = server_args.<field>`` assignments: ``(name, field)``."""
    path = os.path.join(site, WORKER)
    if not os.path.exists(path):
        return ()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    init = next((m for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EAGLEWorker" for m in n.body
                 if isinstance(m, ast.FunctionDef) and m.name == "__init__"), None)
    out = []
    for n in ast.walk(init) if init else ():
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute) and \
                isinstance(n.value.value, ast.Name) and n.value.value.id == "server_args":
            for t in n.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.append((t.attr, n.value.attr))
    return tuple(out)


class _Undetermined(Exception):
    pass


def _eval(src: str, names: dict) -> object:
    try:
        return eval(compile(f"({src})", "<guard>", "eval"), {"__builtins__": builtins}, names)  # noqa: S307
    except Exception as e:  # noqa: BLE001 -- a condition that cannot be evaluated here is undetermined
        raise _Undetermined(f"{type(e).__name__}: {e}") from None


def verdict(site: str, sa, modules: dict | None = None) -> tuple[str | None, list[str]]:
    """``(why, undetermined)``: why the release refuses or rewrites the configuration the
    ServerArgs ``sa`` carries (None: no guard fires), naming each firing guard's ``file:line``
    and condition; ``undetermined``: the guards whose chain could not be evaluated here.

    ``modules``: ``{file: module globals}`` for the guards' own names (``envs``, helpers)."""
    modules = modules or {}
    configured = getattr(sa, TOPK, None)
    worker = {name: getattr(sa, f, None) for name, f in worker_fields(site)}
    v2 = os.path.exists(os.path.join(site, WORKER_V2))
    fired, worker_fired, unknown = [], [], []
    for g in scan(site):
        names = dict(modules.get(g.file, {}))
        if g.owner == "server_args":
            names.update(self=sa, cfg=sa, view=sa, server_args=sa)
        else:
            names["self"] = type("EAGLEWorker", (), worker)()
        try:
            for name, src in g.consts:
                names.setdefault(name, _eval(src, names))
            if not all(bool(_eval(t, names)) == taken for t, taken in g.chain):
                continue
            if g.kind == "refuses" and g.test and bool(_eval(g.test, names)):
                continue
            if g.kind == "rewrites" and _eval(g.value, names) == configured:
                continue
        except _Undetermined as e:
            unknown.append(f"{g.file}:{g.line} ({e})")
            continue
        cond = " and ".join((t if taken else f"not ({t})") for t, taken in g.chain) or g.test
        what = (f"rewrites speculative_eagle_topk {configured} to {g.value}" if g.kind == "rewrites"
                else f"raises ({' '.join(g.what.split())[:160]})")
        said = f"{g.file}:{g.line} ({g.func}) {what} when {' '.join(cond.split())}"
        (worker_fired if g.owner == "worker" else fired).append(said)
    if worker_fired and not v2:  # the only EAGLE worker refuses it
        fired += worker_fired
    elif worker_fired and fired:
        fired += [f"also {w}" for w in worker_fired]
    return ("; ".join(fired) if fired else None), unknown
