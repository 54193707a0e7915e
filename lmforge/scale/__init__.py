"""Scaling laws from lmforge's own runs (`lmforge scale`, whose command line is lmforge/cli/scale.py).

  fit   fit_law: Hoffmann et al.'s approach 3 (Huber on log L, BFGS from a grid) + bootstrap, batched (numpy)
  grid  isoflop_grid: models of a preset's family at compute budgets, as listed sweep trials
  runs  (N, D, L) of finished run folders
  plot  the IsoFLOP plot of a fit

The law itself, Law (L = E + A / N^alpha + B / D^beta) and Fit (a FIT.json: predictions with
intervals, the compute-optimal N and D), is lmforge/spec/scaling_law.py: standard library only, so
that `lmforge plan --loss` reads it below this package.
"""
