"""The production top-k > 1 loop (EAGLE tree): a sibling of the chain engine in
:mod:`refspec.speculative`, read after it.

:mod:`~refspec.speculative.tree.build` (expand, select, tree, greedy accept: the readable host ports),
:mod:`~refspec.speculative.tree.device` (tree and greedy accept as device tensor code: what the rounds run),
:mod:`~refspec.speculative.tree.future` (the next round's inputs on the device, by row),
:mod:`~refspec.speculative.tree.kv` (branch layout, compaction),
:mod:`~refspec.speculative.tree.runners` (verify and draft decode on the FA3 tree backend),
:mod:`~refspec.speculative.tree.graphs` (their CUDA graphs),
:mod:`~refspec.speculative.tree.engine` (the v1 round and :class:`TreeEngine`),
:mod:`~refspec.speculative.tree.v2` (the v2 round, with or without overlap).
"""
