"""Theory: the optimal batch schedule of a functional scaling law and the noisy quadratic model (NQM), exact and online."""
