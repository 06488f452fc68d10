"""The oracle wing: readable pure-PyTorch truth (attention by slot gather, the reference loop).

Modules: ``attention`` (paged attention by slot gather), ``backend`` (the paged oracle backend:
lengths and masks from positions, its own INV-TAIL check), ``dense`` / ``loop`` (the dense top-k = 1
loop), ``slots`` (attention over an explicit key-slot list per row), ``tree`` / ``tree_loop``
(the EAGLE top-k > 1 tree and its dense loop, docs/spec/tree.md).
"""
