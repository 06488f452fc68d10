"""The oracle wing: readable pure-PyTorch truth (attention by slot gather, the reference loop)."""
