"""An engine size at which the seed bug (``seed-page-table``) shows its real symptom, wrong pages.

The bug copies ``max K`` *token slots* into the graph page table, which has one column per page
(``ceil(req_to_token.shape[1] / P)``, CG-008), and the kernel then reads those slot ids as page
ids.  Two sizes decide what happens:

* the table must hold ``max K`` columns, or the copy does not fit (the variant raises CG-008):
  ``max_context = P * need``, where ``need`` = longest prompt + budget + N is the largest K any
  forward sees (tokens);
* every slot id in use must be a valid page id, or the read is out of range (PA-011 in the
  emulator, an illegal address on a GPU): pages handed out in order (no shuffle) and a pool of
  ``P * (B * (ceil(need / P) + 1 + max budget) + 2)`` pages.  A request holds at most
  ``ceil(need / P)`` pages and takes at most one fresh page per round (v1 frees whole tail pages
  to the back of the free list), so every used slot id is below the page count.

``python -m refspec demo --bug`` and tutorial 06 build their engines with these sizes.
"""

from __future__ import annotations


def roomy_sizes(prompts, max_new, *, page_size: int, num_steps: int) -> tuple[int, int]:
    """``(max_context, num_pages)`` for :class:`refspec.speculative.engine.Engine` (module doc).

    ``prompts``: token-id lists; ``max_new``: the per-request budgets (tokens); ``num_steps``:
    draft steps (N = num_steps + 1 at top-k = 1).  Raises ValueError for no prompts, a budget
    count that differs from the prompt count, or a page size / step count below 1.
    """
    if not prompts or len(prompts) != len(max_new):
        raise ValueError(f"roomy_sizes: {len(prompts)} prompts and {len(max_new)} budgets (need one budget each)")
    if page_size < 1 or num_steps < 1:
        raise ValueError(f"roomy_sizes: page_size {page_size} and num_steps {num_steps} must be >= 1")
    P, B = page_size, len(prompts)
    need = max(len(p) + m for p, m in zip(prompts, max_new)) + num_steps + 1
    touched = B * (-(-need // P) + 1 + max(max_new))
    return P * need, P * (touched + 2)
