"""The models: a small HF-named Llama decoder (:mod:`refspec.model.llama`) and the drafts
(:mod:`refspec.model.drafts`).  Attention backends are passed in, never imported."""
