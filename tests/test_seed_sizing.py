"""The seed bug's engine size (``refspec.mutants.sizing``) and its too-narrow symptom (issue 23).

``roomy_sizes`` is checked against numbers worked out by hand; the variant's copy into a table
too narrow for ``max K`` token slots is a one-line CG-008 error, not a raw torch shape error.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refspec.core.invariants import InvariantError
from refspec.core.modes import ForwardMode as M
from refspec.harness.scenario import Scenario
from refspec.mutants import replacements
from refspec.mutants.sizing import roomy_sizes


def test_roomy_sizes_worked_example():
    # prompts of 10 and 7 tokens, budgets 12 and 5, P = 4, 3 draft steps (N = 4):
    # need = max(10 + 12, 7 + 5) + 4 = 26; ceil(26 / 4) = 7; touched = 2 * (7 + 1 + 12) = 40
    assert roomy_sizes([[1] * 10, [1] * 7], [12, 5], page_size=4, num_steps=3) == (4 * 26, 4 * 42)
    # need 3 + 2 + 2 = 7; touched 1 * (7 + 1 + 2) = 10; 10 + 2 pages
    assert roomy_sizes([[1] * 3], [2], page_size=1, num_steps=1) == (7, 12)


@pytest.mark.parametrize("kw, msg", [(dict(prompts=[], max_new=[]), "0 prompts"),
                                     (dict(prompts=[[1]], max_new=[1, 2]), "2 budgets"),
                                     (dict(prompts=[[1]], max_new=[1], page_size=0), "page_size 0")])
def test_roomy_sizes_refuses_bad_input(kw, msg):
    args = dict(page_size=4, num_steps=3) | kw
    with pytest.raises(ValueError, match=msg):
        roomy_sizes(args.pop("prompts"), args.pop("max_new"), **args)


@pytest.mark.spec("CG-008")
def test_seed_bug_copy_that_does_not_fit_is_a_cg008_error():
    b = Scenario(M.TARGET_VERIFY, page_size=4, lens=[9, 14], num_draft_tokens=4).build()
    narrow = SimpleNamespace(page_table=torch.zeros((2, 3), dtype=torch.int32))
    max_k = 14 + 4  # 18 token slots into 3 page columns
    with pytest.raises(InvariantError) as e:
        replacements.slots_as_pages(narrow, b.fb, b.kv.req_to_token, None, max_k, 4)
    assert e.value.inv_id == "CG-008" and "max K = 18" in str(e.value) and "3 columns" in str(e.value)
    wide = SimpleNamespace(page_table=torch.zeros((2, max_k), dtype=torch.int32))
    replacements.slots_as_pages(wide, b.fb, b.kv.req_to_token, None, max_k, 4)  # fits: the wrong copy
    r = [int(x) for x in b.fb.req_pool_indices]
    assert torch.equal(wide.page_table, b.kv.req_to_token[r, :max_k])  # token slots, not page ids
