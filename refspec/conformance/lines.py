"""The upstream lines that ran while a result was built (worker subprocess): a finding cites the
executed line that wrote the field (:func:`refspec.conformance.rules.ran`), not a line read
statically from the file.

:class:`Tracer` records ``sys.settrace`` line events of upstream's own files only (the ``sglang``
package of the code under test: frames of other files, torch, Triton, refspec, get no line
tracing), while one job runs.
Each :func:`mark` (called by ``upstream_common.fields`` when a phase's fields are copied) closes
the segment of lines executed since the previous mark: that phase's lines, in the order they last
ran.  A mark with no line since the previous one (the next draft step's backend, the second part
of a top-k > 1 result) shares the previous segment.  The Triton kernels run in Triton's
interpreter, as Python frames of their own file, so their ``tl.store`` lines are recorded too.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import contextlib
import os
import sys

#: the key under which a result's fields dict carries its executed lines: ``((file, line, via), ...)``,
#: ``via`` the backend file's line (:data:`FA`) running at the time, for a line of another file or of a
#: module-level helper function of the backend file (``draft_decode_set_expand_metadata``)
EXECUTED = "executed_lines"
FA = "sglang/srt/layers/attention/flashattention_backend.py"
_active: Tracer | None = None


class Tracer:
    """Line events of upstream's files (those under ``site``/sglang/, named relative to ``site``)
    while :meth:`job` is entered."""

    def __init__(self, site: str):
        self.site = os.path.realpath(site) + os.sep
        self._names: dict[str, str | None] = {}
        self._seen: dict[tuple[str, int, int | None], int] = {}
        self._n = 0
        self._last: tuple[tuple[str, int, int | None], ...] = ()
        self._marked: list[tuple[dict, tuple]] = []

    def _file(self, name: str) -> str | None:
        if name not in self._names:
            path = os.path.realpath(name)
            ok = path.startswith(self.site + "sglang" + os.sep) and path.endswith(".py")
            self._names[name] = path[len(self.site):] if ok else None
        return self._names[name]

    def _call(self, frame, event, arg):
        rel = self._file(frame.f_code.co_filename)
        if rel is None:
            return None
        via = None
        # a helper or kernel (another file, or a module-level function of the backend's own file):
        # the backend's line that (through calls) ran it
        if rel != FA or "." not in getattr(frame.f_code, "co_qualname", "."):
            f = frame.f_back
            while f is not None and self._file(f.f_code.co_filename) != FA:
                f = f.f_back
            via = None if f is None else f.f_lineno

        def local(f, e, a):
            if e == "line":
                self._n += 1
                self._seen[(rel, f.f_lineno, via)] = self._n
            return local
        return local

    @contextlib.contextmanager
    def job(self):
        """Trace one job (a fresh record; tracing off again on exit)."""
        global _active
        self._seen, self._n, self._last, self._marked = {}, 0, (), []
        _active = self
        sys.settrace(self._call)
        try:
            yield self
        finally:
            sys.settrace(None)
            _active = None

    def mark(self, fields: dict) -> None:
        if self._seen:
            self._last = tuple(k for k, _ in sorted(self._seen.items(), key=lambda kv: kv[1]))
            self._seen = {}
        self._marked.append((fields, self._last))

    def lines_of(self, value) -> tuple | None:
        """The segment marked for ``value`` (a fields dict) or for a fields dict it holds (parts)."""
        for d in (value, *(v for v in value.values() if isinstance(v, dict))):
            for f, lines in self._marked:
                if f is d:
                    return lines
        return None

    def attach(self, result):
        """``result`` (``{(phase, step): fields | error}``) with each fields dict carrying its
        executed lines under :data:`EXECUTED`; an error text or a non-dict result stays as it is."""
        if not isinstance(result, dict):
            return result
        out = {}
        for key, value in result.items():
            lines = self.lines_of(value) if isinstance(value, dict) else None
            out[key] = dict(value, **{EXECUTED: lines}) if lines is not None else value
        return out


@contextlib.contextmanager
def paused():
    """No line tracing inside (a forward run for its kernel calls: its lines are not the metadata's);
    the running job's tracing resumes on exit.  A no-op when not tracing."""
    if _active is None:
        yield
        return
    sys.settrace(None)
    try:
        yield
    finally:
        sys.settrace(_active._call)


def mark(fields: dict) -> dict:
    """Close the running job's segment of executed lines for ``fields`` (no-op when not tracing);
    returns ``fields``."""
    if _active is not None:
        _active.mark(fields)
    return fields
