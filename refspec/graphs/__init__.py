"""CUDA graphs, real and emulated (:mod:`refspec.graphs.capture`), and the padded-replay
graph runner (:mod:`refspec.graphs.runner`)."""
