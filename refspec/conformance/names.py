"""The names ``python -m refspec conformance`` checks its arguments against, importable without torch.

The case builders (:mod:`refspec.conformance.cases`, :mod:`~refspec.conformance.tree_cases`,
:mod:`~refspec.conformance.mla_forward`) import torch and refspec's whole FA3 wing (several seconds);
a usage error should not wait for that.  These are copies of their names, kept equal to them by
``tests/test_conformance_cli.py`` (a drift there fails that test, naming the module).

An instrument: a learner reading the reference can skip this module.
"""

from __future__ import annotations

#: :data:`refspec.conformance.cases.MODES`' names (top-k = 1)
FLAT_MODES = ("decode", "extend", "extend_prefix", "verify", "draft_decode", "draft_extend", "draft_extend_v2",
              "idle")
#: :data:`refspec.conformance.tree_cases.MODES` (top-k > 1)
TREE_MODES = ("tree_verify", "tree_draft_decode")
#: :data:`refspec.conformance.mla_forward.MODES`: upstream's MLA forward path, one per MHA mode but idle
MLA_MODES = tuple("mla_" + m for m in FLAT_MODES[:-1] + TREE_MODES)
#: every mode ``--modes`` takes by name
MODES = (*sorted(FLAT_MODES), *TREE_MODES, *MLA_MODES)
#: ``--modes`` groups: a group stands for those of its modes the code has (a mode it lacks is skipped, said,
#: not an error)
GROUPS = {"mla": MLA_MODES}
#: the page sizes some case uses (:data:`refspec.conformance.cases.PAGE_SIZES` and the tree cases')
PAGE_SIZES = (1, 2, 4, 8, 16, 64)
#: :data:`refspec.conformance.tree_cases.TOPKS`
TOPKS = (2, 4, 8)
#: :data:`refspec.conformance.mla_forward.GRIDS`
MLA_GRIDS = ("default", "full", "off")


def expand(modes) -> list[str]:
    """``--modes`` names with each group (:data:`GROUPS`) replaced by its modes, in order, once each."""
    return list(dict.fromkeys(m for x in modes for m in GROUPS.get(x, (x,))))


def parse_expected(text: str, keys=None) -> dict[str, set[str]]:
    """``--expect-bugs LABEL:KEY[,LABEL:KEY...]`` -> ``{target label: {known bug key, ...}}``.

    ``keys``: the known upstream bugs' keys (:data:`refspec.conformance.known.BUGS`); None checks
    the form only; empty items are skipped (``--expect-bugs ,`` expects no known bug: strict).
    Raises: ValueError naming the item: one without ``:`` (or without a label or a key), a key
    ``keys`` does not have (the keys listed)."""
    out: dict[str, set[str]] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        label, sep, key = item.rpartition(":")
        if not sep or not label or not key:
            raise ValueError(f"{item}: expected LABEL:KEY, a target and a known upstream bug "
                             f"(e.g. 0.5.23:context-wall-page-table)")
        if keys is not None and key not in keys:
            raise ValueError(f"{item}: {key} is no known upstream bug; the known ones: {', '.join(sorted(keys))}")
        out.setdefault(label, set()).add(key)
    return out
