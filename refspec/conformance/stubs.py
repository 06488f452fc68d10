"""Raising placeholders for the packages upstream imports but never calls on the metadata path.

Runs only inside the conformance worker subprocess (:mod:`refspec.conformance.worker`), never
in refspec itself.  SGLang's import chain reaches serving-only packages (HTTP, tokenizers, the
CUDA kernel library ``sgl_kernel``...) that the metadata builders never call.  They are not
installed; each is replaced by a :class:`StubModule` whose attributes are :class:`Placeholder`
objects.  Two phases:

* import time (:func:`install` until :func:`arm`): reading a stub attribute yields a
  placeholder, so ``from orjson import dumps`` works; every *name* handed out is logged;
* run time (after :func:`arm`): reading any stub-module attribute, any placeholder attribute,
  or calling a placeholder raises :class:`StubUsed`.  A placeholder is never truthy, never
  iterable and has no value, so it can never silently stand in for upstream behaviour: a case
  that reaches one fails loudly and is reported as an error, not as "same".

At import time a call (``logger = logging.get_logger(__name__)``, a decorator) returns one
more placeholder, and ``class X(placeholder)`` builds an empty class whose instantiation raises
at run time; a truth test or iteration raises in both phases.

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import sys
import types

_ARMED = False
_HANDED_OUT: set[str] = set()


class StubUsed(RuntimeError):
    """Upstream code touched a stubbed package at run time (the comparison is then void)."""


def _used(what: str):
    raise StubUsed(f"{what}: a stub of an absent package was used at run time; the metadata path "
                   f"must not depend on it (refspec.conformance.stubs)")


class Placeholder:
    """An import-time stand-in for one attribute of a stubbed module (see the module doc)."""

    __slots__ = ("_stub_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_stub_name", name)
        _HANDED_OUT.add(name)

    def __call__(self, *args, **kwargs):
        if _ARMED:
            _used(f"call of {self._stub_name}")
        return Placeholder(f"{self._stub_name}()")

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        if _ARMED:
            _used(f"read of {self._stub_name}.{attr}")
        return Placeholder(f"{self._stub_name}.{attr}")

    def __bool__(self):  # noqa: PLE0304 -- never returns: a placeholder has no truth value
        _used(f"truth value of {self._stub_name}")

    def __iter__(self):
        _used(f"iteration over {self._stub_name}")

    def __getitem__(self, key):
        if _ARMED:
            _used(f"{self._stub_name}[{key!r}]")
        return Placeholder(f"{self._stub_name}[{key!r}]")

    def __setitem__(self, key, value):  # ``CONFIG_MAPPING._extra_content[k] = v`` at import
        if _ARMED:
            _used(f"{self._stub_name}[{key!r}] = ...")

    def __or__(self, other):  # ``X | None`` in annotations evaluated at import time
        return Placeholder(f"{self._stub_name} | ...")

    __ror__ = __or__

    def __mro_entries__(self, bases):
        name = self._stub_name

        class _StubBase:
            def __init_subclass__(cls, **kwargs):  # ``class X(stub, total=False)``
                super().__init_subclass__()

            def __init__(self, *a, **k):
                if _ARMED:
                    _used(f"instance of a subclass of {name}")

        _StubBase.__name__ = f"Stub[{name}]"
        return (_StubBase,)

    def __repr__(self):
        return f"<stub {self._stub_name}>"


class StubModule(types.ModuleType):
    """A module of placeholders; after :func:`arm` every attribute read raises."""

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        if _ARMED:
            _used(f"read of {self.__name__}.{attr}")
        value = Placeholder(f"{self.__name__}.{attr}")
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = StubModule(spec.name)
        m.__path__ = []  # a package, so ``import orjson.x`` resolves through this finder too
        return m

    def exec_module(self, module):
        if _ARMED:
            _used(f"import of {module.__name__}")


def install(roots) -> None:
    """Stub every module under the top-level names ``roots``.

    The stubs win over an installed copy (the caller's environment may have, say, a real
    ``transformers``): what upstream imports from these packages must be the same, inert,
    raising placeholder on every machine, whatever else is installed.
    """
    sys.meta_path.insert(0, _StubFinder(set(roots)))


def for_importers(statements: dict) -> None:
    """Stub single import statements of named modules: ``{importer: {dotted name, ...}}``.

    A statement of module ``importer`` (by its ``__name__``) is stubbed when every name it asks
    for is listed for that importer: ``from vllm import _custom_ops`` asks for
    ``vllm._custom_ops``, ``from vllm.a.b import X, Y`` for ``vllm.a.b.X`` and ``vllm.a.b.Y``,
    ``import vllm.a`` for ``vllm.a``; a listed ``vllm.a.*`` covers every name below ``vllm.a``.
    It then gets a :class:`StubModule` (not entered in
    ``sys.modules``).  Any other statement, of that module or any other, goes to the real import
    system, so a probe (``try: import vllm ... except ImportError``) still finds the package
    absent.  Wraps ``builtins.__import__`` (the worker subprocess only).
    """
    allowed = {k: frozenset(v) for k, v in statements.items()}
    roots = {n.split(".")[0] for v in allowed.values() for n in v}
    real = builtins.__import__

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in roots:
            ok = allowed.get((globals or {}).get("__name__"), ())
            asked = [f"{name}.{f}" for f in fromlist] if fromlist else [name]
            if ok and all(a in ok or any(o.endswith(".*") and a.startswith(o[:-1]) for o in ok) for a in asked):
                if _ARMED:
                    _used(f"import of {name}")
                _HANDED_OUT.update(asked)
                return StubModule(name if fromlist else name.split(".")[0])
        return real(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped_import


def replace_module(name: str) -> None:
    """Put a stub in place of one module that exists on disk but is never used on this path."""
    m = StubModule(name)
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, m)


def bare_package(name: str, directory: str) -> None:
    """Register package ``name`` without running its ``__init__`` (its submodules load from disk)."""
    m = types.ModuleType(name)
    m.__path__ = [directory]
    m.__file__ = None
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, m)


def provide(module: str, name: str, value=None) -> None:
    """Bind ``module.name`` explicitly, for a name upstream imports *at run time* from a stub.

    ``value=None`` binds a :class:`Placeholder` (storing it is fine, calling it raises); any
    other value is a deliberate run-time setting, listed by the worker in its report.
    """
    __import__(module)
    mod = sys.modules[module]
    mod.__dict__[name] = Placeholder(f"{module}.{name}") if value is None else value


def arm() -> None:
    """Enter run time: from now on any use of a stub raises :class:`StubUsed`."""
    global _ARMED
    _ARMED = True


def handed_out() -> list[str]:
    """Names of the placeholders created at import time (reported by the worker)."""
    return sorted(_HANDED_OUT)
